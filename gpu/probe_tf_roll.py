"""Probe: the transformers integration's rolling-sweep slice per part (export, derive, plan, verifies) and the batch
view's, each timed around its call (median and mean µs, host). Usage: python3 gpu/probe_tf_roll.py [cuda|cpu] [1b|tiny]
[batch] [prompt]."""

import contextlib
import io
import runpy
import statistics
import sys

import kvcanary.integrations.transformers as kt
import kvcanary.manager as mg
import kvcanary.sweep as sw

from bench.call_times import time_calls

times: dict[str, list[float]] = {}
for owner, names in ((mg.CanaryManager, ("_roll",)), (sw.Sweeper, ("roll", "_derive", "_verify")),
                     (kt.HFPoolAdapter, ("prefix_cache_export", "_build_export", "forget_hashes", "_read_slots")),
                     (kt, ("new_token_truth", "export_of_blocks"))):
    for name in names:
        time_calls(owner, name, times)  # type: ignore[arg-type]
sys.argv = ["gpu/probe_tf_parts.py", *sys.argv[1:]]
with contextlib.redirect_stdout(io.StringIO()):
    runpy.run_path("gpu/probe_tf_parts.py", run_name="__main__")
for name, ts in times.items():
    med, mean = 1e6 * statistics.median(ts), 1e6 * statistics.mean(ts)
    print(f"  {name:20s} n={len(ts):4d} median {med:8.1f} us  mean {mean:8.1f} us")
