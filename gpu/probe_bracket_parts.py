"""Probe: where the host time of bench_runtime's decode bracket goes (eager and replayed, per batch size): the nested
parts of begin_forward, pre/post (the native sequence call) and end_forward, each timed around its call (inclusive,
median and mean µs per call; a wrapped part adds well under a µs to its callers). Usage: python3
gpu/probe_bracket_parts.py [cuda|cpu] [iters] [batch sizes, default 1,64]."""

import statistics
import sys
import time

import kvcanary.adapter as ad
import kvcanary.health as hl
import kvcanary.manager as mg
import kvcanary.program as pg
import kvcanary.reporting as rp
import kvcanary.upload as up
import torch
from kvcanary.ops.stage_batch import BatchStager

from bench.bench_runtime import bench_case, bench_replay
from bench.call_times import time_calls

PARTS = ((mg.CanaryManager, ("begin_forward", "_begin_steady", "_begun", "_report_due", "end_forward", "_on_report")),
         (ad.BatchView, ("check_table",)), (pg.DeviceProgram, ("bound_shape", "launch")), (pg, ("run",)),
         (up.Upload, ("steady", "_held", "_decode", "_staged")), (BatchStager, ("decode",)),
         (rp.Reporter, ("stage", "collect", "_report", "alarmed", "_dispatch")),
         (hl.Health, ("check", "expect_forward")))


def floor(device: torch.device, n: int = 2000) -> None:
    """Host µs per call of a native op that returns before launching (bookkeep with nothing to do: the FFI call and
    its five tensor arguments), of a one-kernel torch op and of the same native op launching a kernel."""
    from kvcanary import _native  # noqa: PLC0415

    mod = _native.module(device.type)
    z = torch.zeros(0, dtype=torch.int64, device=device)
    one = torch.zeros(1, dtype=torch.int64, device=device)
    mirror = torch.zeros(0, dtype=torch.int64)
    calls = {"native, no launch": lambda: mod.bookkeep(z, z, z, z, mirror),
             "native, one launch": lambda: mod.bookkeep(one, z, z, z, mirror),
             "torch add_": lambda: one.add_(1)}
    for name, fn in calls.items():
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        print(f"  floor {name:20s} median {1e6 * statistics.median(ts):6.2f} us")


def _time_native(owner: type, attr: str, times: dict[str, list[float]]) -> None:
    """After ``owner.__init__``, its instance's ``attr`` (a bound native function) timed as ``native <attr>``."""
    init = owner.__init__

    def wrapped_init(self: object, *a: object, **k: object) -> None:
        init(self, *a, **k)
        fn = getattr(self, attr)

        def timed(*args: object) -> object:
            t = time.perf_counter()
            try:
                return fn(*args)
            finally:
                times.setdefault(f"native {attr}", []).append(time.perf_counter() - t)
        setattr(self, attr, timed)
    owner.__init__ = wrapped_init  # type: ignore[misc]


def main() -> None:
    device = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 500
    sizes = [int(b) for b in (sys.argv[3] if len(sys.argv) > 3 else "1,64").split(",")]
    times: dict[str, list[float]] = {}
    for owner, names in PARTS:
        for name in names:
            time_calls(owner, name, times)
    floor(device)
    _time_native(BatchStager, "_decode", times)  # the native call itself
    try:  # a tree before stage_window (an A/B's A side) has no window stager
        from kvcanary.ops.stage_window import WindowStager  # noqa: PLC0415
        _time_native(WindowStager, "_fn", times)
    except ImportError:
        pass
    cases = [("eager", bench_case)] + ([("replay", bench_replay)] if device.type == "cuda" else [])
    for mode, fn in cases:
        for bs in sizes:
            times.clear()
            row = fn(bs, 128, device.type, device, iters)
            print(f"== {mode} bs {bs}: total median {row['total_us']} us, mean {row['total_mean_us']} us")
            for name, ts in times.items():
                print(f"  {name:16s} n={len(ts):5d} median {1e6 * statistics.median(ts):7.1f} us  "
                      f"mean {1e6 * statistics.fmean(ts):7.1f} us")


if __name__ == "__main__":
    main()
