"""Probe (GPU machine): CanaryManager.invalidate of a host slot list on the demo's target pool, warm (median of 300
calls), whole and step by step, and the aten ops one call runs (torch profiler).
Usage: python3 gpu/probe_invalidate.py."""

import numpy as np
import torch
from kvcanary import campaign as C
from kvcanary.engine.canary import EngineCanary
from probe_torch_ops import timed
from torch.profiler import ProfilerActivity, profile

engine = C.build_engine((), False, "cuda")
canary = EngineCanary(engine, C.POLICIES["default"]("cuda"))
m = canary.target
g = next(g for g in m.state.groups if g.spare is not None and g.poison is not None)
d, n, r = m.state.device, g.spec.num_slots, g.spec.reserved_slots
slots = torch.arange(8, 16, dtype=torch.int64)
host = slots.numpy()
buf = torch.empty(8, dtype=torch.int64, pin_memory=True)
idx = buf.to(d)
steps = {
    "invalidate (whole)": lambda: m.invalidate(slots),
    "slots.numpy()": lambda: slots.numpy(),
    "empty pinned": lambda: torch.empty(8, dtype=torch.int64, pin_memory=True),
    "np.where into pinned": lambda: buf.numpy().__setitem__(slice(None), np.where((host >= r) & (host < n), host, n)),
    "h2d": lambda: buf.to(d, non_blocking=True),
    "poison.expand": lambda: g.poison.expand(-1, 8, -1, -1),
    "index_copy_": lambda: g.spare.index_copy_(1, idx, g.poison.expand(-1, 8, -1, -1)),
}
for name, fn in steps.items():
    print(f"{name:24s} warm median {1e6 * timed(fn)[1]:7.1f} us")
with profile(activities=[ProfilerActivity.CPU]) as prof:
    m.invalidate(slots)
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))
