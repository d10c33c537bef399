"""Probe: host µs of the begin's native staging calls on CUDA, to split ``begin_decode``'s cost between its launch (its
parameters: the inline staging rows) and the rest. Per batch size: ``begin_decode`` (a steady decode, its row chains
restored before each call, outside the timer) and ``stage_batch`` of the same batch from a pinned staging row; and the
floor (a one-launch native op). The calls run round-robin, so that each sees the same host state.
Usage: python3 gpu/probe_stage_launch.py [iters] [batch sizes, default 1,64,65,256] [device, default cuda]."""

import statistics
import sys
import time
from collections.abc import Callable

import torch
from kvcanary import _native
from kvcanary.upload import _sources, host_array, host_i64

from bench.bench_runtime import make_config, warmed

DEV = torch.device(sys.argv[3] if len(sys.argv) > 3 else "cuda")


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


Call = tuple[Callable[[], object], Callable[[], object] | None]  # (the timed call, its untimed preparation)


def case(bs: int) -> dict[str, Call]:
    """The calls of a steady bs-row decode on a fresh manager: begin_decode (its rows' chains restored first) and
    stage_batch from a pinned staging row."""
    w, m = warmed(bs, 64, 8, DEV, make_config("default", DEV.type, bs, 64))
    b = w.batch(1)
    up = m.upload
    src = _sources(b)
    rows, pre, ext = (host_i64(v) for v in (b.req_pool_indices_host, b.prefix_lens_host, b.extend_lens_host))
    live = rows != m.pool.padding_row
    new = host_array(b.true_new_tokens)
    shape = m.program.bound_shape(bs, int(b.input_ids.shape[0]))
    pads = up._pads(bs, int(b.input_ids.shape[0]), shape)
    h, nn = up.chains.h.copy(), up.chains.n.copy()

    def restore() -> None:
        up.chains.h[:], up.chains.n[:] = h, nn

    def decode() -> None:
        got = up._stage.decode(src, 0, *pads, (rows, pre, ext), new, live, up._row_state, up.chains.offset, 3)
        if got < 0:
            raise SystemExit(f"begin_decode declined the batch: {got}")
    def stage() -> None:
        up._stage(src, 0, *pads)
    return {f"bs {bs} begin_decode": (decode, restore), f"bs {bs} stage_batch": (stage, None)}


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    calls: dict[str, Call] = {}
    for bs in (int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "1,64,65,256").split(",")):
        calls.update(case(bs))
    mod = _native.module(DEV.type)
    z = torch.zeros(0, dtype=torch.int64, device=DEV)
    one = torch.zeros(1, dtype=torch.int64, device=DEV)
    mirror = torch.zeros(0, dtype=torch.int64)
    calls["floor: one-launch native op"] = (lambda: mod.bookkeep(one, z, z, z, mirror), None)
    times: dict[str, list[float]] = {k: [] for k in calls}
    for i in range(n):  # round-robin: every call sees the same host state
        for name, (fn, before) in calls.items():
            if before is not None:
                before()
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
        if i % 16 == 15:
            sync()
    sync()
    for name, ts in times.items():
        print(f"{name:32s} median {1e6 * statistics.median(ts):6.2f} us", flush=True)


if __name__ == "__main__":
    main()
