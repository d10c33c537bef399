"""Slot-row fill (docs/ops-contract.md 12, 12a): an engine's per-request read slots and its write slots, in its own
addressing, converted to table-space slots and filled into slot-table rows in one call, optionally with the row facts
staged from the host in the same call; torch references + native."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable

import numpy as np
import torch
import tvm_ffi
from kvcanary_schema import NO_SLOT

from kvcanary import _native
from kvcanary.errors import CanaryInputError
from kvcanary.ops.plan import check_scalar
from kvcanary.ops.types import Backend, check_backend, check_tensor

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
    tbl, stride, page, b = _checked_table(table, stride, page, backend)
    args = _checked_call(tbl, rows, starts, lens, src, out, write)
    if b == "torch":
        slot_rows_torch(tbl, *args, stride, page)
        return
    _native_call(_native.module(b).slot_rows, "slot_rows", tbl, *args, stride, page)


_Call = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
FACT_ROWS = 5  # stage_slot_rows' staged rows: rows, prefix lengths, extend lengths, kv lengths, read starts
_I64 = (-(2**63), 2**63)


def _checked_table(table: torch.Tensor, stride: int, page: int,
                   backend: str) -> tuple[torch.Tensor, int, int, Backend]:
    """The static arguments checked: the table, stride, page and the backend of the table's device."""
    tbl = check_tensor(table, "table", dtype=_INDEX, ndim=2)
    stride, page = check_scalar(stride, "stride", 1), check_scalar(page, "page", 1)
    if stride < page:
        raise CanaryInputError(f"slot_rows needs page <= stride, got page {page}, stride {stride}")
    return tbl, stride, page, check_backend(backend, tbl.device)


def _checked_call(tbl: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, src: torch.Tensor,
                  out: torch.Tensor, write: torch.Tensor) -> _Call:
    """A call's tensors checked against the table (dtypes, dims, lengths, device)."""
    d = tbl.device
    r = check_tensor(rows, "rows", ndim=1, device=d)
    bs = r.shape[0]
    st = check_tensor(starts, "starts", ndim=1, device=d, shape=(bs,))
    ln = check_tensor(lens, "lens", ndim=1, device=d, shape=(bs,))
    return (r, st, ln, *_checked_slots(tbl, src, out, write))


def _checked_slots(tbl: torch.Tensor, src: torch.Tensor, out: torch.Tensor,
                   write: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The read slots, converted write slots and write slots checked against the table."""
    d = tbl.device
    s = check_tensor(src, "src", dtype=_INDEX, ndim=1, device=d)
    o = check_tensor(out, "out", ndim=1, device=d)
    w = check_tensor(write, "write", dtype=_INDEX, ndim=1, device=d, shape=(o.shape[0],))
    return s, o, w


def stage_slot_rows(table: torch.Tensor, facts_in: np.ndarray, staging: torch.Tensor, facts: torch.Tensor,
                    src: torch.Tensor, out: torch.Tensor, write: torch.Tensor, stride: int, page: int,
                    backend: str = "torch", event: int = 0) -> None:
    """:func:`slot_rows` with its row facts staged from the host in the same call (docs/ops-contract.md 12a).

    ``facts_in`` int64 ``[3, bs]`` (host): each request's row, prefix length and extend length. ``staging`` int64
    ``[5, W >= bs]`` (host memory, pinned for the CUDA backend) and ``facts`` int64 ``[5, W]`` (the table's device; it
    may be ``staging`` itself) get, in their first ``bs`` columns, the rows, prefix lengths, extend lengths, kv lengths
    (prefix + extend) and read starts (the exclusive prefix sums of the kv lengths); then ``slot_rows(table, rows,
    starts, kv, src, out, write, stride, page)``. ``event``: CUDA backend, a live ``cudaEvent_t`` of the table's
    device as an int (0: none) guarding ``staging``: awaited before it is written, recorded after the copy that reads
    it. The CUDA backend passes a batch of at most ``STAGE_INLINE_ROWS`` requests in the launch instead (outside a
    capture): ``staging`` and ``event`` are then untouched. Bad input (12's, the facts' shapes, a sum outside int64, a
    non-zero event off CUDA) raises CanaryInputError before anything is written.
    """
    tbl, stride, page, b = _checked_table(table, stride, page, backend)
    args = (*_checked_facts(tbl, facts_in, staging, facts), *_checked_slots(tbl, src, out, write))
    if b == "torch":
        if event != 0:
            raise CanaryInputError("stage_slot_rows: event must be 0 off the CUDA backend")
        stage_slot_rows_torch(tbl, *args, stride, page)
        return
    _native_call(_native.module(b).stage_slot_rows, "stage_slot_rows", tbl, *args, stride, page, event)


def _native_call(fn: Callable[..., None], name: str, *args: object) -> None:
    """A native entry's call, its argument checks' errors raised as this library's input error."""
    try:
        fn(*args)
    except (TypeError, ValueError) as err:
        raise CanaryInputError(f"{name}: {err}") from err


def _checked_facts(tbl: torch.Tensor, facts_in: np.ndarray, staging: torch.Tensor,
                   facts: torch.Tensor) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """stage_slot_rows' fact arrays checked against the table (the sums are checked where they are computed)."""
    if not isinstance(facts_in, np.ndarray) or facts_in.dtype != np.int64 or facts_in.ndim != 2 or \
            facts_in.shape[0] != 3 or not facts_in.flags.c_contiguous:
        raise CanaryInputError("facts_in must be a C-contiguous int64 numpy array [3, bs]")
    st = check_tensor(staging, "staging", dtype=torch.int64, ndim=2, device=torch.device("cpu"),
                      shape=(FACT_ROWS, None))
    f = check_tensor(facts, "facts", dtype=torch.int64, ndim=2, device=tbl.device, shape=(FACT_ROWS, st.shape[1]))
    if facts_in.shape[1] > st.shape[1]:
        raise CanaryInputError(f"staging has {st.shape[1]} columns, the batch has {facts_in.shape[1]} requests")
    return facts_in, st, f


def stage_slot_rows_torch(table: torch.Tensor, facts_in: np.ndarray, staging: torch.Tensor, facts: torch.Tensor,
                          src: torch.Tensor, out: torch.Tensor, write: torch.Tensor, stride: int, page: int) -> None:
    """Reference of the native op (no argument checks but the sums'; Python ints, then one copy to the device)."""
    rows, pre, ext = facts_in.tolist()
    kv = list(map(operator.add, pre, ext))
    starts = list(itertools.accumulate(kv, initial=0))
    if any(not _I64[0] <= v < _I64[1] for v in kv + starts):
        raise CanaryInputError("stage_slot_rows: a kv length (prefix + extend) or read start leaves int64")
    bs = len(rows)
    staging[:, :bs] = torch.tensor([rows, pre, ext, kv, starts[:-1]], dtype=torch.int64)
    if facts.data_ptr() != staging.data_ptr():
        facts[:, :bs].copy_(staging[:, :bs])
    slot_rows_torch(table, facts[0, :bs], facts[4, :bs], facts[3, :bs], src, out, write, stride, page)


class SlotRowStager:
    """:func:`stage_slot_rows` bound to one slot table, with its own buffers: the static arguments checked (and for a
    native backend converted) once, the staging pinned for CUDA (on the CPU the device facts are the staging), one
    CUDA event guarding it, and each batch width's device fact views made once. A native backend checks a call's
    tensors in the native entry alone (an engine's batch view calls it every forward), before anything is written."""

    def __init__(self, table: torch.Tensor, stride: int, page: int, width: int, backend: str = "torch") -> None:
        """Room for batches of up to ``width`` requests."""
        self.table, self.stride, self.page, self.backend = _checked_table(table, stride, page, backend)
        width = check_scalar(width, "width", 0)
        cuda = self.table.device.type == "cuda"
        self.staging = torch.zeros((FACT_ROWS, width), dtype=torch.int64, pin_memory=cuda)
        self.facts = torch.zeros((FACT_ROWS, width), dtype=torch.int64, device=self.table.device) if cuda \
            else self.staging
        self._event = 0
        if cuda:  # the event's handle exists once it is recorded; kept alive with this object
            self._guard = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._guard.record(torch.cuda.current_stream(self.table.device))
            self._event = int(self._guard.cuda_event)
        self._native: Callable[..., None] | None = None
        self._static: tuple[object, ...] = (self.table, self.staging, self.facts)
        if self.backend != "torch":
            self._native = _native.module(self.backend).stage_slot_rows
            self._static = tuple(tvm_ffi.from_dlpack(t) for t in self._static)
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def __call__(self, facts_in: np.ndarray, src: torch.Tensor, out: torch.Tensor,
                 write: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Stage ``facts_in`` (int64 ``[3, bs]``) and fill the table's rows from ``src`` (converting ``write`` into
        ``out``); the batch's rows, prefix and extend lengths on the table's device (views of the facts, overwritten
        by the next call: work that reads them must be queued on the current stream before it)."""
        if self._native is None:
            stage_slot_rows(self.table, facts_in, self.staging, self.facts, src, out, write, self.stride, self.page)
        else:  # src, out and write stay torch tensors: tvm-ffi takes torch's current stream from them
            tbl, staging, facts = self._static
            _native_call(self._native, "stage_slot_rows", tbl, facts_in, staging, facts, src, out, write, self.stride,
                         self.page, self._event)
        bs = facts_in.shape[1]
        v = self._views.get(bs)
        if v is None:
            v = self._views[bs] = (self.facts[0, :bs], self.facts[1, :bs], self.facts[2, :bs])
        return v


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
