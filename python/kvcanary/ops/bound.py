"""Bound op calls: arguments validated once, the slot table passed per call (the per-forward device program)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import tvm_ffi


@dataclass(frozen=True)
class BoundOp:
    """``fn(*before, table, *after)``: an op whose every argument but the slot table was checked when it was bound
    (``takes_table`` False: ``fn(*before, *after)``, the table ignored).

    The caller guarantees that a table passed to :meth:`__call__` passes the same checks as the one it was bound with
    (int32/int64, 2-D, contiguous, on the device, same column count: what ``BatchView.validate`` checks).
    """

    fn: Callable[..., Any]
    before: tuple[Any, ...]
    after: tuple[Any, ...]
    native: bool = False  # a tvm-ffi function (its tensor arguments may be pre-converted)
    takes_table: bool = True

    def __call__(self, table: torch.Tensor) -> None:
        """Run the op on ``table``."""
        if self.takes_table:
            self.fn(*self.before, table, *self.after)
        else:
            self.fn(*self.before, *self.after)

    def frozen(self) -> BoundOp:
        """Native ops: torch tensor arguments pre-converted to tvm-ffi tensors (no per-call DLPack exchange). The table
        stays a torch tensor, so tvm-ffi still takes torch's current stream from it (graph capture works)."""
        if not self.native:
            return self

        def conv(args: tuple[Any, ...]) -> tuple[Any, ...]:
            return tuple(tvm_ffi.from_dlpack(a) if isinstance(a, torch.Tensor) else a for a in args)
        return BoundOp(self.fn, conv(self.before), conv(self.after), True, self.takes_table)
