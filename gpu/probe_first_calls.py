"""Probe: one-time costs of the ops the engine export uses (first pinned allocation, first launch of each kernel:
lazy module loading), each timed with the device idle. Usage: python3 gpu/probe_first_calls.py."""
import time

import torch

d = torch.device("cuda")
x = torch.arange(1000, device=d)
y = x + 1
torch.cuda.synchronize()  # the context and a first kernel


def t(name, fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    print(f"{name:40s} {1e3*(time.perf_counter()-t0):8.3f} ms", flush=True)
t("first pinned empty", lambda: torch.empty(100, dtype=torch.int64, pin_memory=True))
p = torch.empty(100, dtype=torch.int64, pin_memory=True)
t("second pinned empty", lambda: torch.empty(100, dtype=torch.int64, pin_memory=True))
t("pinned 1 MB", lambda: torch.empty(1 << 17, dtype=torch.int64, pin_memory=True))
t("first non_blocking H2D", lambda: p.to(d, non_blocking=True))
t("second non_blocking H2D", lambda: p.to(d, non_blocking=True))
idx = torch.zeros(10, dtype=torch.int64, device=d)
t("first index_select", lambda: x.index_select(0, idx))
t("second index_select", lambda: x.index_select(0, idx))
t("first masked_fill_", lambda: x.clone().masked_fill_(x == 0, -1))
t("second masked_fill_", lambda: x.clone().masked_fill_(x == 0, -1))
t("first cumsum", lambda: torch.cumsum(x, 0))
t("first cat", lambda: torch.cat([x, y]))
t("first ne", lambda: x != 0)
t("first where scalar", lambda: torch.where(x == 0, x, -1))
