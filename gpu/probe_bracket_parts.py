"""Probe: where the host time of bench_runtime's decode bracket goes (eager and graph replay, bs 1 and 64): the nested
parts of begin_forward, pre/post (the native sequence call) and end_forward, each timed around its call (inclusive,
median and mean µs per call; a wrapped part adds well under a µs to its callers). Usage: python3
gpu/probe_bracket_parts.py [cuda|cpu] [iters]."""

import statistics
import sys

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
         (ad.BatchView, ("check_table",)), (pg.DeviceProgram, ("bound_shape",)), (mg, ("run",)),
         (up.Upload, ("steady", "_held", "_decode", "_staged")), (BatchStager, ("decode",)),
         (rp.Reporter, ("stage", "collect", "_report", "alarmed", "_dispatch")), (hl.Health, ("check", "expect_forward")))


def main() -> None:
    device = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 500
    times: dict[str, list[float]] = {}
    for owner, names in PARTS:
        for name in names:
            time_calls(owner, name, times)
    cases = [("eager", bench_case)] + ([("replay", bench_replay)] if device.type == "cuda" else [])
    for mode, fn in cases:
        for bs in (1, 64):
            times.clear()
            row = fn(bs, 128, device.type, device, iters)
            print(f"== {mode} bs {bs}: total median {row['total_us']} us, mean {row['total_mean_us']} us")
            for name, ts in times.items():
                print(f"  {name:16s} n={len(ts):5d} median {1e6 * statistics.median(ts):7.1f} us  "
                      f"mean {1e6 * statistics.fmean(ts):7.1f} us")


if __name__ == "__main__":
    main()
