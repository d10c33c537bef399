"""Probe (GPU machine): line-by-line host time of the canary's hooks inside transformers continuous batching (the
decode steps of gpu/probe_tf_parts.py's run): the bracket, the batch view, the steady begin, the stage launches and the
stream switch. Needs line_profiler (carry its wheel). Usage: python3 gpu/profile_tf_lines.py [cuda|cpu] [1b|tiny]
[batch] [prompt]."""

import runpy
import sys

import kvcanary.integrations.transformers as kt
import kvcanary.manager as mg
import kvcanary.ops.slot_rows as sr
import kvcanary.program as pg
import kvcanary.streams as st
import kvcanary.upload as up
from line_profiler import LineProfiler

prof = LineProfiler()
for owner, names in ((mg.CanaryManager, ("begin_forward", "_begin_steady", "_begin", "_begun", "_report_due",
                                         "pre_forward", "post_forward", "end_forward", "_roll")),
                     (up.Upload, ("steady", "_decode", "_held", "_staged", "begin")),
                     (kt.HFPoolAdapter, ("batch_view", "_views", "_read_slots")), (kt._Session, ("_bracket",)),
                     (kt._Batch, ("new_tokens",)), (sr.SlotRowStager, ("__call__",)), (pg.DeviceProgram, ("launch",)),
                     (pg.EagerGraphs, ("__call__",)), (st.StreamSwitch, ("enter", "leave"))):
    for name in names:
        setattr(owner, name, prof(getattr(owner, name)))
runpy.run_path("gpu/probe_tf_parts.py", run_name="__main__")
prof.print_stats(output_unit=1e-6, stripzeros=True)
sys.stdout.flush()
