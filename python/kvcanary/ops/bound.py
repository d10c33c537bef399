"""Bound op calls: arguments validated once, the slot table (and optionally the batch's shape) passed per call."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import tvm_ffi
from kvcanary_schema import ShapedArg
from torch.utils.dlpack import from_dlpack

from kvcanary.errors import CanaryInputError


@dataclass(frozen=True)
class Shaped:
    """A bound argument that follows the batch shape of a call (``kind``: how), as given to :meth:`BoundOp.of`."""

    value: Any
    kind: ShapedArg


@dataclass(frozen=True)
class BoundOp:
    """``fn(*before, table, *after)``: an op whose every argument but the slot table was checked when it was bound
    (``takes_table`` False: ``fn(*before, *after)``, the table ignored).

    The arguments at ``shaped`` ((index into ``before + after``, ShapedArg) pairs) follow the batch: bound at the
    largest batch, a call given a shape (rows, tokens) cuts them to it (docs/ops-contract.md 9); without one they run as
    bound.
    The caller guarantees that a table passed to :meth:`__call__` passes the same checks as the one it was bound with
    (int32/int64, 2-D, contiguous, on the device, same column count: what ``BatchView.validate`` checks).
    """

    fn: Callable[..., Any]
    before: tuple[Any, ...]
    after: tuple[Any, ...]
    native: bool = False  # a tvm-ffi function (its tensor arguments may be pre-converted)
    takes_table: bool = True
    shaped: tuple[tuple[int, ShapedArg], ...] = ()

    @classmethod
    def of(cls, fn: Callable[..., Any], before: tuple[Any, ...], after: tuple[Any, ...], *, native: bool = False,
           takes_table: bool = True) -> BoundOp:
        """The bound call, its :class:`Shaped` arguments unwrapped and noted in ``shaped``."""
        args = (*before, *after)
        shaped = tuple((i, a.kind) for i, a in enumerate(args) if isinstance(a, Shaped))
        plain = tuple(a.value if isinstance(a, Shaped) else a for a in args)
        return cls(fn, plain[:len(before)], plain[len(before):], native, takes_table, shaped)

    def __call__(self, table: torch.Tensor, rows: int | None = None, tokens: int = 0) -> None:
        """Run the op on ``table``; with ``rows``, its shaped arguments cut to a batch of ``rows`` rows and ``tokens``
        new tokens (here in Python: the device program runs native ops through ``make_sequence``, which cuts them)."""
        before, after = (self.before, self.after) if rows is None or not self.shaped else self._cut(rows, tokens)
        if self.takes_table:
            self.fn(*before, table, *after)
        else:
            self.fn(*before, *after)

    def _cut(self, rows: int, tokens: int) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        args = [*self.before, *self.after]
        for i, kind in self.shaped:
            if kind == ShapedArg.NUM_TOKENS:
                if not 0 <= tokens <= args[i]:
                    raise CanaryInputError(f"a batch of {tokens} tokens past the bound {args[i]}")
                args[i] = tokens
                continue
            a = args[i] if isinstance(args[i], torch.Tensor) else from_dlpack(args[i])  # a frozen op's tensor
            n = tokens if kind == ShapedArg.TOKENS else max(rows, 1) if kind == ShapedArg.PLAN_ROWS else rows
            if not 0 <= n <= a.shape[0]:
                raise CanaryInputError(f"a batch of {n} {'tokens' if kind == ShapedArg.TOKENS else 'rows'} past the "
                                       f"bound {a.shape[0]}")
            args[i] = a[:n]
        return tuple(args[:len(self.before)]), tuple(args[len(self.before):])

    def frozen(self) -> BoundOp:
        """Native ops: torch tensor arguments pre-converted to tvm-ffi tensors (no per-call DLPack exchange). The table
        stays a torch tensor, so tvm-ffi still takes torch's current stream from it (graph capture works)."""
        if not self.native:
            return self

        def conv(args: tuple[Any, ...]) -> tuple[Any, ...]:
            return tuple(tvm_ffi.from_dlpack(a) if isinstance(a, torch.Tensor) else a for a in args)
        return BoundOp(self.fn, conv(self.before), conv(self.after), True, self.takes_table, self.shaped)

    def shaped_pairs(self) -> list[int]:
        """``shaped`` as flat (index, kind) pairs (``make_sequence``'s form)."""
        return [v for i, kind in self.shaped for v in (i, int(kind))]
