"""Stage bookkeeping (docs/ops-contract.md 10): a stage counter and a running maximum, torch reference + native."""

from __future__ import annotations

import torch

from kvcanary import _native
from kvcanary.ops.bound import BoundOp
from kvcanary.ops.types import check_backend, check_tensor


def bind_bookkeep(counter: torch.Tensor, acc: torch.Tensor, src: torch.Tensor, backend: str = "torch") -> BoundOp:
    """``counter += 1`` (every element) and ``acc = max(acc, src)``, checked once; the bound op takes no slot
    table."""
    c = check_tensor(counter, "counter", ndim=1)
    a = check_tensor(acc, "acc", ndim=1, device=c.device)
    s = check_tensor(src, "src", ndim=1, device=c.device, shape=(a.shape[0],))
    b = check_backend(backend, c.device)
    if b == "torch":
        return BoundOp(bookkeep_torch, (c, a, s), (), takes_table=False)
    return BoundOp(_native.module(b).bookkeep, (c, a, s), (), native=True, takes_table=False)


def bookkeep_torch(counter: torch.Tensor, acc: torch.Tensor, src: torch.Tensor) -> None:
    """Reference of the native op (no argument checks)."""
    counter.add_(1)
    torch.maximum(acc, src, out=acc)
