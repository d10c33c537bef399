"""Probe (GPU machine): line-by-line host time of the canary's hot functions in the demo's clean run (a cold run
first, unprofiled, then a profiled warm run of the same 100 forwards). Needs line_profiler (carry its wheel).
Usage: python3 gpu/profile_lines.py [cuda|cpu] [--drain]; --drain: synchronize before each engine hook, so the
hooks' lines show host work, not waits on the engine's queued kernels."""

import sys

import kvcanary.engine.canary as ec
import kvcanary.engine.engine as en
import kvcanary.engine.radix as rx
import kvcanary.manager as mg
import kvcanary.program as pg
import kvcanary.sweep as sw
import kvcanary.upload as up
import torch
from kvcanary.demo import clean_run
from line_profiler import LineProfiler

device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
clean_run(0, device, device, 100, quiet=True)
prof = LineProfiler()
for owner, names in ((ec.EngineCanary, ("before_forward", "after_forward", "on_free", "_export")),
                     (ec, ("batch_view",)),
                     (mg.CanaryManager, ("begin_forward", "_begin_steady", "_begin", "_begun", "pre_forward",
                                         "post_forward", "end_forward", "invalidate", "_roll")),
                     (up.Upload, ("steady", "begin", "_staged", "_claim", "_pads")),
                     (pg.DeviceProgram, ("stages", "bound_shape")),
                     (sw.Sweeper, ("roll", "_derive", "_verify")),
                     (en.Engine, ("resident_chains",)), (rx.RadixCache, ("export_host",)), (rx, ("packed",))):
    for name in names:
        fn = getattr(owner, name)
        wrapped = prof(fn)
        setattr(owner, name, wrapped)
if "--drain" in sys.argv and device == "cuda":
    for hook in ("before_forward", "after_forward", "on_free"):
        inner = getattr(ec.EngineCanary, hook)

        def drained(self, *a, _inner=inner, **k):
            torch.cuda.synchronize()
            return _inner(self, *a, **k)
        setattr(ec.EngineCanary, hook, drained)
clean_run(0, device, device, 100, quiet=True)
prof.print_stats(output_unit=1e-6, stripzeros=True)
