"""Probe (GPU machine): the host time of the small torch calls the canary's host paths use (invalidate, the reference
engine's export), warm (median of 300 calls) and on first use in this process (cold: a kernel's first launch may load
its module). Usage: python3 gpu/probe_torch_ops.py."""

import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

d = torch.device("cuda")
spare = torch.zeros(2, 4097, 2, 4, dtype=torch.int64, device=d)
poison = torch.zeros(2, 1, 2, 4, dtype=torch.int64, device=d)
flat = torch.arange(1 << 16, dtype=torch.int64, device=d)
host_slots = torch.arange(8, dtype=torch.int64)
idx_d = torch.arange(8, dtype=torch.int64, device=d)
out = torch.zeros(64, dtype=torch.int64, device=d)
a, b = torch.ones(8, dtype=torch.int64, device=d), torch.ones(8, dtype=torch.int64, device=d)


def pinned() -> torch.Tensor:
    return torch.empty(64, dtype=torch.uint8, pin_memory=True)


def h2d_pinned() -> torch.Tensor:
    return PIN.to(d, non_blocking=True)


def h2d_pageable() -> torch.Tensor:
    return host_slots.to(d, non_blocking=True)


PIN = torch.empty(64, dtype=torch.int64, pin_memory=True)
OPS = {
    "empty pinned": pinned,
    "h2d pinned": h2d_pinned,
    "h2d pageable": h2d_pageable,
    "numpy where (8)": lambda: np.where((host_slots.numpy() >= 1) & (host_slots.numpy() < 9), host_slots.numpy(), 9),
    "clamp": lambda: idx_d.clamp(0, 100),
    "lt": lambda: idx_d < 1,
    "masked_fill_": lambda: out[:8].masked_fill_(idx_d < 1, 9),
    "index_fill_": lambda: spare.index_fill_(1, idx_d, 0),
    "select index_fill_": lambda: spare.select(3, 1).index_fill_(1, idx_d, -1),
    "index_copy_ expanded": lambda: spare.index_copy_(1, idx_d, poison.expand(-1, 8, -1, -1)),
    "flat[idx]": lambda: flat[idx_d],
    "index_select out=": lambda: torch.index_select(flat, 0, idx_d, out=out[8:16]),
    "addcmul out=": lambda: torch.addcmul(a, a, b, out=out[16:24]),
    "mul": lambda: a * b,
    "add_": lambda: out[:8].add_(a),
    "copy_ slice": lambda: out[24:32].copy_(a),
    "cat 2": lambda: torch.cat([a, b]),
    "split 8": lambda: torch.split(out, [8] * 8),
    "view int64 of uint8": lambda: PIN.view(torch.uint8)[:64].view(torch.int64),
    "zeros bool": lambda: torch.zeros(8, dtype=torch.bool, device=d),
}
def timed(fn: Callable[[], object], calls: int = 300) -> tuple[float, float]:
    """(the first call's seconds, the warm median's) of ``fn``, the device drained around the warm calls."""
    t0 = time.perf_counter()
    fn()
    cold = time.perf_counter() - t0
    torch.cuda.synchronize()
    dts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        dts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return cold, statistics.median(dts)


if __name__ == "__main__":
    for name, fn in OPS.items():  # cold: the first call in this process
        cold, warm = timed(fn)
        print(f"{name:24s} warm median {1e6 * warm:7.1f} us   first call {1e3 * cold:8.2f} ms")
