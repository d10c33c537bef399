"""Probe: the eager bracket's pre/post stages launched op by op (``CanaryConfig(eager_graphs=False)``) vs from their
CUDA graphs (the default, program.EagerGraphs). Prints host µs per stage (median and mean over alternating blocks of
forwards) and checks that both leave the same records, sink and arena (two managers on the same seeded workload).
Usage: python3 gpu/probe_eager_graphs.py [iters]."""

import statistics
import sys
import time

import torch
from kvcanary.manager import CanaryManager, install

from bench.bench_runtime import Workload, _gc_off, make_config

DEV = torch.device("cuda")


def make(bs: int, prefix: int, iters: int, graphs: bool) -> tuple[Workload, CanaryManager]:
    w = Workload(bs, prefix, iters + 40, DEV)
    return w, install(w.pool(), make_config("default", "cuda", bs, prefix).replace(eager_graphs=graphs))


def bracket(w: Workload, m: CanaryManager, times: dict[str, list[float]] | None, extend: int = 1) -> None:
    m.begin_forward(w.batch(extend))
    t0 = time.perf_counter()
    m.pre_forward()
    t1 = time.perf_counter()
    m.post_forward()
    t2 = time.perf_counter()
    m.end_forward()
    if times is not None:
        times["pre"].append(t1 - t0)
        times["post"].append(t2 - t1)


def main() -> None:
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    for bs in (1, 64, 256):
        prefix = 128
        pairs = {"direct": make(bs, prefix, iters, False), "graph": make(bs, prefix, iters, True)}
        for w, m in pairs.values():
            bracket(w, m, None, prefix)
            for _ in range(32):  # past the capture of the decode shape's stages
                bracket(w, m, None)
        times: dict[str, dict[str, list[float]]] = {k: {"pre": [], "post": []} for k in pairs}
        with _gc_off():
            for _block in range(iters // 20):
                for name, (w, m) in pairs.items():
                    for _ in range(20):
                        torch.cuda.synchronize()
                        bracket(w, m, times[name])
        torch.cuda.synchronize()
        (_, ma), (_, mb) = pairs.values()
        ma.flush()
        mb.flush()
        same = all(torch.equal(x.records, y.records) for x, y in zip(ma.state.groups, mb.state.groups, strict=True))
        same &= torch.equal(ma.state.sink.count, mb.state.sink.count)
        same &= torch.equal(ma.state.arena, mb.state.arena)
        graphs = mb.program.graphs
        print(f"bs {bs}: graphs {0 if graphs is None else len(graphs.graphs)}, same state {same}, violations "
              f"{sum(r.total for r in ma.reports)}/{sum(r.total for r in mb.reports)}")
        for name, t in times.items():
            print("  " + name + "  " + "  ".join(
                f"{k} median {statistics.median(v) * 1e6:6.1f} mean {statistics.fmean(v) * 1e6:6.1f} us"
                for k, v in t.items()))


if __name__ == "__main__":
    main()
