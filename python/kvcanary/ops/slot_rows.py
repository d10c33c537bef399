"""Slot-row fill (docs/ops-contract.md 12): an engine's per-request read slots and its write slots, in its own
addressing, converted to table-space slots and filled into slot-table rows in one call; torch reference + native."""

from __future__ import annotations

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
    tbl = check_tensor(table, "table", dtype=_INDEX, ndim=2)
    d = tbl.device
    r = check_tensor(rows, "rows", ndim=1, device=d)
    bs = r.shape[0]
    st = check_tensor(starts, "starts", ndim=1, device=d, shape=(bs,))
    ln = check_tensor(lens, "lens", ndim=1, device=d, shape=(bs,))
    s = check_tensor(src, "src", dtype=_INDEX, ndim=1, device=d)
    o = check_tensor(out, "out", ndim=1, device=d)
    w = check_tensor(write, "write", dtype=_INDEX, ndim=1, device=d, shape=(o.shape[0],))
    stride, page = check_scalar(stride, "stride", 1), check_scalar(page, "page", 1)
    if stride < page:
        raise CanaryInputError(f"slot_rows needs page <= stride, got page {page}, stride {stride}")
    b = check_backend(backend, d)
    if b == "torch":
        slot_rows_torch(tbl, r, st, ln, s, o, w, stride, page)
        return
    _native.module(b).slot_rows(tbl, r, st, ln, s, o, w, stride, page)


class SlotRows:
    """:func:`slot_rows` into one slot table, its static arguments (``table``, ``stride``, ``page``, the backend)
    checked once. A native backend's per-call tensors are checked by the native entry alone (an engine's batch view
    calls this every forward), its errors raised as CanaryInputError before anything is written; the torch backend
    checks every call in Python."""

    def __init__(self, table: torch.Tensor, stride: int, page: int, backend: str = "torch") -> None:
        self.table = check_tensor(table, "table", dtype=_INDEX, ndim=2)
        self.stride, self.page = check_scalar(stride, "stride", 1), check_scalar(page, "page", 1)
        if stride < page:
            raise CanaryInputError(f"slot_rows needs page <= stride, got page {page}, stride {stride}")
        self.backend = check_backend(backend, self.table.device)
        self._native = None if self.backend == "torch" else _native.module(self.backend).slot_rows

    def __call__(self, rows: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, src: torch.Tensor,
                 out: torch.Tensor, write: torch.Tensor) -> None:
        """``slot_rows(table, rows, starts, lens, src, out, write, stride, page)`` on the bound arguments."""
        if self._native is None:
            slot_rows(self.table, rows, starts, lens, src, out, write, self.stride, self.page, "torch")
            return
        try:
            self._native(self.table, rows, starts, lens, src, out, write, self.stride, self.page)
        except (TypeError, ValueError) as err:  # the native entry's checks, as this library's input error
            raise CanaryInputError(f"slot_rows: {err}") from err


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
