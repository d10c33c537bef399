"""Window staging (docs/ops-contract.md 13): a reporting window's head and kept violation rows into a tagged host
snapshot and its counts reset, in one call (CUDA: one launch, no copy, event record or event query); torch reference +
native."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import tvm_ffi

from kvcanary import _native
from kvcanary.errors import CanaryInputError
from kvcanary.ops.types import check_backend, check_tensor, overlaps

_CPU = torch.device("cpu")
_Args = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def stage_window(head: torch.Tensor, count: torch.Tensor, rows: torch.Tensor, reset: torch.Tensor, dst: torch.Tensor,
                 tag: int, backend: str = "torch") -> None:
    """``dst[1:1+h] = head``, ``dst[1+h : 1+h+k*c] = rows[:k]`` with ``k = clamp(count[0], 0, cap)``, then
    ``reset[:] = 0`` and last ``dst[0] = tag`` (every read before any write; CUDA: the tag written once the rest is
    visible to the host). ``head`` int64 ``[h]``, ``count`` ``[1]``, ``rows`` ``[cap, c]``, ``reset`` ``[r]`` on one
    device (they may overlap); ``dst`` int64 ``[1 + h + cap*c]`` host memory overlapping none of them, pinned on CUDA.
    Entries of ``dst`` past row ``k`` are unspecified."""
    h, c, r, z, out = check_stage_window(head, count, rows, reset, dst)
    b = check_backend(backend, head.device)
    if b == "torch":
        stage_window_torch(h, c, r, z, out, tag)
        return
    _native.module(b).stage_window(h, c, r, z, out, tag)


def check_stage_window(head: torch.Tensor, count: torch.Tensor, rows: torch.Tensor, reset: torch.Tensor,
                       dst: torch.Tensor) -> _Args:
    """The contract's checks (CanaryInputError); the arguments as checked tensors."""
    h = check_tensor(head, "head", ndim=1)
    d = h.device
    c = check_tensor(count, "count", ndim=1, device=d, shape=(1,))
    r = check_tensor(rows, "rows", ndim=2, device=d)
    z = check_tensor(reset, "reset", ndim=1, device=d)
    out = check_tensor(dst, "dst", ndim=1, device=_CPU, shape=(1 + h.shape[0] + r.numel(),))
    if d.type == "cuda" and not out.is_pinned():
        raise CanaryInputError("dst must be pinned host memory (torch pin_memory=True) on a CUDA device")
    for t, name in ((h, "head"), (c, "count"), (r, "rows"), (z, "reset")):
        if d.type == "cpu" and overlaps(out, t):
            raise CanaryInputError(f"dst must not overlap {name}")
    return h, c, r, z, out


def stage_window_torch(head: torch.Tensor, count: torch.Tensor, rows: torch.Tensor, reset: torch.Tensor,
                       dst: torch.Tensor, tag: int) -> None:
    """Reference of the native op (no argument checks; every row copied): on a CUDA device the copies run in stream
    order, the tag's last."""
    h = head.shape[0]
    dst[1:1 + h].copy_(head, non_blocking=True)
    dst[1 + h:].copy_(rows.flatten(), non_blocking=True)
    reset.zero_()
    dst[:1].copy_(torch.full((1,), tag, dtype=torch.int64, device=head.device), non_blocking=True)


class WindowStager:
    """stage_window with its arguments bound once (one destination per double-buffered snapshot), checked here (the
    native entry checks them again on every call) and, for a native backend, all but ``head`` pre-converted to tvm-ffi
    tensors (``head`` stays a torch tensor, so tvm-ffi takes torch's current stream from it)."""

    def __init__(self, head: torch.Tensor, count: torch.Tensor, rows: torch.Tensor, reset: torch.Tensor,
                 dsts: Sequence[torch.Tensor], backend: str) -> None:
        for dst in dsts:
            check_stage_window(head, count, rows, reset, dst)
        b = self.backend = check_backend(backend, head.device)
        self._fn: Callable[..., None] = stage_window_torch if b == "torch" else _native.module(b).stage_window
        native = b != "torch"
        self._head = head
        conv: Callable[[torch.Tensor], object] = tvm_ffi.from_dlpack if native else (lambda t: t)
        self._args = (conv(count), conv(rows), conv(reset))
        self._dsts = [conv(d) for d in dsts]

    def __call__(self, k: int, tag: int) -> None:
        """Stage into destination ``k`` with ``tag``."""
        self._fn(self._head, *self._args, self._dsts[k], tag)
