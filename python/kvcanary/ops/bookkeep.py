"""Stage bookkeeping (docs/ops-contract.md 10): a stage counter, a running maximum and a tagged mirror in pinned host
memory; torch reference + native."""

from __future__ import annotations

import torch

from kvcanary import _native
from kvcanary.errors import CanaryInputError
from kvcanary.ops.bound import BoundOp
from kvcanary.ops.types import check_backend, check_tensor


def bind_bookkeep(counter: torch.Tensor, acc: torch.Tensor, src: torch.Tensor, backend: str = "torch",
                  mirror_src: torch.Tensor | None = None, mirror: torch.Tensor | None = None) -> BoundOp:
    """``counter += 1`` (every element) and ``acc = max(acc, src)``; with a mirror, then ``mirror[1:] = mirror_src``
    and last ``mirror[0] = counter[0]`` (``mirror``: host int64 [len(mirror_src) + 1], pinned on a CUDA device, so that
    the host reads it with no copy). Checked once; the bound op takes no slot table."""
    c = check_tensor(counter, "counter", ndim=1)
    a = check_tensor(acc, "acc", ndim=1, device=c.device)
    s = check_tensor(src, "src", ndim=1, device=c.device, shape=(a.shape[0],))
    b = check_backend(backend, c.device)
    ms, m = _mirror_args(c, mirror_src, mirror)
    if b == "torch":
        return BoundOp(bookkeep_torch, (c, a, s, ms, m), (), takes_table=False)
    return BoundOp(_native.module(b).bookkeep, (c, a, s, ms, m), (), native=True, takes_table=False)


def _mirror_args(counter: torch.Tensor, mirror_src: torch.Tensor | None,
                 mirror: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(mirror_src, mirror), empty without a mirror."""
    if (mirror_src is None) != (mirror is None):
        raise CanaryInputError("mirror_src and mirror go together")
    if mirror_src is None or mirror is None:
        return counter[:0], torch.zeros(0, dtype=torch.int64)
    ms = check_tensor(mirror_src, "mirror_src", ndim=1, device=counter.device)
    m = check_tensor(mirror, "mirror", ndim=1, device=torch.device("cpu"), shape=(ms.shape[0] + 1,))
    if ms.shape[0] == 0 or counter.shape[0] == 0:
        raise CanaryInputError("a mirror needs values to mirror and a counter to tag them")
    if counter.device.type == "cuda" and not m.is_pinned():
        raise CanaryInputError("mirror must be pinned host memory (torch pin_memory=True) on a CUDA device")
    return ms, m


def bookkeep_torch(counter: torch.Tensor, acc: torch.Tensor, src: torch.Tensor, mirror_src: torch.Tensor,
                   mirror: torch.Tensor) -> None:
    """Reference of the native op (no argument checks): on a CUDA device the mirror's two copies run in stream order,
    values before the tag."""
    counter.add_(1)
    torch.maximum(acc, src, out=acc)
    if mirror_src.shape[0]:
        mirror[1:].copy_(mirror_src, non_blocking=True)
        mirror[:1].copy_(counter[:1], non_blocking=True)
