"""Probe (GPU machine): every canary hook call's host time in the demo's clean run, cold (first run in the process)
and warm (repeated): where the cold run's extra time lands (which hook, which forward) and how the slowest calls
split between the manager's steps, down to the parts of begin_forward's general path (the upload, its token truth,
checks, claims and staging call) and the engine's batch view. Usage: python3 gpu/probe_hook_times.py [cuda|cpu]."""

import statistics
import sys
import time
from collections import defaultdict

import kvcanary.adapter as ad
import kvcanary.engine.canary as ec
import kvcanary.manager as mg
import kvcanary.ops.stage_batch as sb
import kvcanary.sweep as sw
import kvcanary.truth as tr
import kvcanary.upload as up
import torch
from kvcanary.demo import clean_run

CALLS: list[tuple[str, float]] = []
STEPS: dict[str, list[float]] = defaultdict(list)


def timed(owner: type, name: str, sink: list | dict) -> None:
    """Wrap owner.name so that each call's duration is recorded."""
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            if isinstance(sink, list):
                sink.append((name, dt))
            else:
                sink[name].append(dt)
    setattr(owner, name, wrapper)


for hook in ("before_forward", "after_forward", "on_free"):
    timed(ec.EngineCanary, hook, CALLS)
for step in ("begin_forward", "pre_forward", "post_forward", "end_forward", "invalidate", "_roll", "sweep"):
    timed(mg.CanaryManager, step, STEPS)
for step in ("_derive", "_verify"):  # the rolling sweep's parts beside the export (_derive binds the slice planner)
    timed(sw.Sweeper, step, STEPS)
timed(ec.EngineCanary, "_export", STEPS)
timed(sw, "derive_roll", STEPS)
for owner, step in ((mg.CanaryManager, "_begin"), (mg.CanaryManager, "_begin_steady"), (mg.CanaryManager, "_begun"),
                    (up.Upload, "begin"), (up.Upload, "_truth"), (up.Upload, "_claim"), (up.Upload, "_staged"),
                    (ad.BatchView, "validate_arrays"), (tr.RowChains, "forward"), (sb.BatchStager, "__call__"),
                    (torch.cuda.Event, "synchronize"), (ec, "batch_view")):  # begin_forward's parts
    timed(owner, step, STEPS)

device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
for label in ("cold", "warm"):
    CALLS.clear()
    STEPS.clear()
    res = clean_run(0, device, device, 100, quiet=True)
    total = sum(dt for _, dt in CALLS)
    fw = sum(p["forwards"] for p in res["phases"])
    top = sorted(CALLS, key=lambda c: -c[1])[:12]
    print(f"{label}: {fw} forwards, hooks {1e3 * total / fw:.3f} ms/fw; top 12 calls "
          f"{1e3 * sum(dt for _, dt in top):.1f} ms: " + ", ".join(f"{n} {1e3 * dt:.1f}" for n, dt in top))
    for name, dts in sorted(STEPS.items()):
        dts.sort()
        print(f"  {name:14s} n={len(dts):4d} total {1e3 * sum(dts):8.1f} ms  median "
              f"{1e6 * statistics.median(dts):7.1f} us  max {1e3 * dts[-1]:7.2f} ms"
              f"  top3 {1e3 * sum(dts[-3:]):7.2f} ms")
