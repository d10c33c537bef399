"""Slot-row fill (docs/ops-contract.md 12): an engine's per-request read slots and its write slots, in its own
addressing, converted to table-space slots and filled into slot-table rows in one call; torch reference + native."""

from __future__ import annotations

from collections.abc import Callable

import torch
from kvcanary_schema import NO_SLOT

from kvcanary import _native
from kvcanary.errors import CanaryInputError
from kvcanary.ops.plan import check_scalar
from kvcanary.ops.types import check_backend, check_tensor

_INDEX = (torch.int32, torch.int64)
_INT32_MAX = torch.iinfo(torch.int32).max


def slot_rows(table: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, src: torch.Tensor,
              out: torch.Tensor, write: torch.Tensor, stride: int, page: int, backend: str = "torch") -> None:
    """Fill ``table`` rows from the engine's flat read slots and convert its write slots.

    ``table`` int32/int64 ``[R, L]``; ``rows``, ``starts``, ``lens`` int64 ``[bs]``; ``src`` int32/int64 ``[m]``
    (request i's read slots at ``src[starts[i] : starts[i] + lens[i]]``, positions 0, 1, ...); ``out`` int64 ``[n]`` and
    ``write`` int32/int64 ``[n]``; all on one device. ``table[rows[i], j] = slot(src[starts[i] + j])`` for
    ``j < min(lens[i], L)``; a request whose row lies outside the table or whose segment leaves ``src`` fills nothing
    (the plan reports its row or lengths). Requests apply in order: a row named twice holds, at each position, the
    last of them that reaches it. ``out[k] = slot(write[k])``. ``slot(s)``: the engine addresses blocks of
    ``stride`` rows of which the first ``page`` are token slots, so ``slot(s) = s - (s // stride) * (stride - page)``
    for ``s >= 0`` with ``s % stride < page``, else NO_SLOT (and NO_SLOT for a slot an int32 table cannot hold).
    """
    bind_slot_rows(table, stride, page, backend, check_calls=True)(rows, starts, lens, src, out, write)


SlotRowsFn = Callable[..., None]  # (rows, starts, lens, src, out, write)
_Call = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def bind_slot_rows(table: torch.Tensor, stride: int, page: int, backend: str = "torch",
                   check_calls: bool = False) -> SlotRowsFn:
    """:func:`slot_rows` into ``table``: ``table``, ``stride``, ``page`` and the backend checked once, a call that takes
    ``(rows, starts, lens, src, out, write)``. A native backend's call tensors are checked by the native entry alone
    (an engine's batch view binds it once and calls it every forward), its errors raised as CanaryInputError before
    anything is written; the torch backend, and any backend with ``check_calls``, checks them in Python first."""
    tbl = check_tensor(table, "table", dtype=_INDEX, ndim=2)
    stride, page = check_scalar(stride, "stride", 1), check_scalar(page, "page", 1)
    if stride < page:
        raise CanaryInputError(f"slot_rows needs page <= stride, got page {page}, stride {stride}")
    b = check_backend(backend, tbl.device)
    native = None if b == "torch" else _native.module(b).slot_rows

    def run(rows: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, src: torch.Tensor, out: torch.Tensor,
            write: torch.Tensor) -> None:
        args: _Call = (rows, starts, lens, src, out, write)
        if native is None:
            slot_rows_torch(tbl, *_checked_call(tbl, *args), stride, page)
            return
        try:
            native(tbl, *(_checked_call(tbl, *args) if check_calls else args), stride, page)
        except (TypeError, ValueError) as err:  # the native entry's checks, as this library's input error
            raise CanaryInputError(f"slot_rows: {err}") from err
    return run


def _checked_call(tbl: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, src: torch.Tensor,
                  out: torch.Tensor, write: torch.Tensor) -> _Call:
    """A call's tensors checked against the bound table (dtypes, dims, lengths, device)."""
    d = tbl.device
    r = check_tensor(rows, "rows", ndim=1, device=d)
    bs = r.shape[0]
    st = check_tensor(starts, "starts", ndim=1, device=d, shape=(bs,))
    ln = check_tensor(lens, "lens", ndim=1, device=d, shape=(bs,))
    s = check_tensor(src, "src", dtype=_INDEX, ndim=1, device=d)
    o = check_tensor(out, "out", ndim=1, device=d)
    w = check_tensor(write, "write", dtype=_INDEX, ndim=1, device=d, shape=(o.shape[0],))
    return r, st, ln, s, o, w


def table_slots_torch(s: torch.Tensor, stride: int, page: int) -> torch.Tensor:
    """The reference of the conversion: the table-space slot of every engine slot of ``s`` (int64)."""
    s = s.to(torch.int64)
    block = torch.div(s, stride, rounding_mode="floor")
    ok = (s >= 0) & (s - block * stride < page)
    return torch.where(ok, s - block * (stride - page), NO_SLOT)


def slot_rows_torch(table: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
                    src: torch.Tensor, out: torch.Tensor, write: torch.Tensor, stride: int, page: int) -> None:
    """Reference of the native op (no argument checks; one host read of the row facts)."""
    R, L, m = table.shape[0], table.shape[1], src.shape[0]
    slots = table_slots_torch(src, stride, page)
    if table.dtype == torch.int32:
        slots = torch.where(slots > _INT32_MAX, NO_SLOT, slots)
    for row, start, n in zip(rows.tolist(), starts.tolist(), lens.tolist(), strict=True):
        if 0 <= row < R and start >= 0 and 0 <= n <= m - start and start <= m:
            k = min(n, L)
            table[row, :k] = slots[start:start + k].to(table.dtype)
    out.copy_(table_slots_torch(write, stride, page))
