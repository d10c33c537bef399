"""Probe: the eager bracket's pre/post stages as direct native sequence calls vs each stage captured once per (stage
ops, shape, slot table) into a CUDA graph and launched with one graph launch. Prints host µs per stage (median and
mean of alternating blocks) and checks that both ways leave the same records, sink and window counts (two managers
on the same seeded workload). Usage: python3 gpu/probe_eager_graphs.py [iters]."""

import statistics
import sys
import time

import torch
from kvcanary.manager import CanaryManager, install
from kvcanary.program import run

from bench.bench_runtime import Workload, _gc_off, make_config

DEV = torch.device("cuda")


class Graphed:
    """Each (ops, shape, table) captured on its first call, then launched as one graph."""

    def __init__(self) -> None:
        self.graphs: dict[tuple[int, tuple[int, int], int], torch.cuda.CUDAGraph] = {}
        self.side = torch.cuda.Stream(DEV)

    def __call__(self, ops: tuple, table: torch.Tensor, shape: tuple[int, int]) -> None:
        key = (id(ops), shape, table.data_ptr())
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = torch.cuda.CUDAGraph()
            self.side.wait_stream(torch.cuda.current_stream(DEV))
            with torch.cuda.stream(self.side):
                g.capture_begin(capture_error_mode="thread_local")
                run(ops, table, shape)
                g.capture_end()
            torch.cuda.current_stream(DEV).wait_stream(self.side)
        g.replay()


def make(bs: int, prefix: int, iters: int) -> tuple[Workload, CanaryManager]:
    w = Workload(bs, prefix, iters + 4, DEV)
    return w, install(w.pool(), make_config("default", "cuda", bs, prefix))


def bracket(w: Workload, m: CanaryManager, graphed: Graphed | None, times: dict[str, list[float]] | None,
            extend: int = 1) -> None:
    m.begin_forward(w.batch(extend))
    t0 = time.perf_counter()
    if graphed is None:
        m.pre_forward()
    else:
        graphed(m._ops[0], m._slot_table(), m._shape)
        m._phase = type(m._phase).PRE
    t1 = time.perf_counter()
    if graphed is None:
        m.post_forward()
    else:
        graphed(m._ops[1], m._slot_table(), m._shape)
        m._phase = type(m._phase).POST
    t2 = time.perf_counter()
    m.end_forward()
    if times is not None:
        times["pre"].append(t1 - t0)
        times["post"].append(t2 - t1)


def main() -> None:
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    for bs in (1, 64, 256):
        prefix = 128
        (wa, ma), (wb, mb) = make(bs, prefix, iters), make(bs, prefix, iters)
        g = Graphed()
        for w, m, gr in ((wa, ma, None), (wb, mb, g)):
            bracket(w, m, gr, None, prefix)
            bracket(w, m, gr, None)
        times = {k: {"pre": [], "post": []} for k in ("direct", "graph")}
        with _gc_off():
            for block in range(iters // 20):
                for name, w, m, gr in (("direct", wa, ma, None), ("graph", wb, mb, g)):
                    for _ in range(20):
                        torch.cuda.synchronize()
                        bracket(w, m, gr, times[name])
        torch.cuda.synchronize()
        ra, rb = ma.flush(), mb.flush()
        same = all(torch.equal(x.records, y.records) for x, y in zip(ma.state.groups, mb.state.groups))
        same &= torch.equal(ma.state.sink.count, mb.state.sink.count)
        same &= torch.equal(ma.state.arena, mb.state.arena)
        tot = (sum(r.total for r in ma.reports), sum(r.total for r in mb.reports))
        print(f"bs {bs}: graphs {len(g.graphs)}, same state {same}, violations {tot}")
        for name, t in times.items():
            print("  " + name + "  " + "  ".join(
                f"{k} median {statistics.median(v) * 1e6:6.1f} mean {statistics.fmean(v) * 1e6:6.1f} us"
                for k, v in t.items()))


if __name__ == "__main__":
    main()
