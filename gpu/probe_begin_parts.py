"""Probe (GPU machine): host time of the parts of begin_forward (and of the engine's batch view) in the demo's clean
run, cold and warm, median per call. Usage: python3 gpu/probe_begin_parts.py [cuda|cpu]."""

import statistics
import sys
import time
from collections import defaultdict

import kvcanary.adapter as ad
import kvcanary.engine.canary as ec
import kvcanary.manager as mg
import kvcanary.ops.stage_batch as sb
import kvcanary.program as pg
import kvcanary.rows as rw
import kvcanary.truth as tr
import kvcanary.upload as up
import torch
from kvcanary.demo import clean_run

TIMES: dict[str, list[float]] = defaultdict(list)


def timed(owner: object, name: str) -> None:
    """Wrap owner.name so that each call's duration is recorded under its name."""
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name].append(time.perf_counter() - t0)
    setattr(owner, name, wrapper)


for owner, name in ((mg.CanaryManager, "_begin"), (mg.CanaryManager, "_begin_steady"), (mg.CanaryManager, "_begun"),
                    (mg.CanaryManager, "_report_due"), (up.Upload, "begin"), (up.Upload, "_truth"),
                    (up.Upload, "_claim"), (ad.BatchView, "validate_arrays"), (ad.BatchView, "validate_fit"),
                    (tr.RowChains, "forward"), (pg.DeviceProgram, "_bind"), (ec, "batch_view"),
                    (rw.RequestRows, "ran"), (rw.RequestRows, "unclaimed"), (sb.BatchStager, "__call__"),
                    (up.Upload, "_staged"), (torch.cuda.Event, "synchronize")):
    timed(owner, name)

device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
for label in ("cold", "warm"):
    TIMES.clear()
    clean_run(0, device, device, 100, quiet=True)
    for name, dts in sorted(TIMES.items()):
        print(f"{label} {name:16s} n={len(dts):4d} median {1e6 * statistics.median(dts):8.1f} us "
              f"total {1e3 * sum(dts):7.2f} ms")
