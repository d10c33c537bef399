"""What one request's transfer carries: the KV rows and canary records of its slots, packed into one byte buffer."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from kvcanary_schema import Group, Stage

from kvcanary.errors import CanaryInputError

# Every item's segment starts on this boundary so that it can be viewed back as its dtype (int64 records after a
# bf16 KV segment of an odd number of rows, for instance).
SEGMENT_ALIGN = 16


@dataclass(frozen=True)
class TransferItem:
    """One per-slot buffer that travels: a KV layer tensor or a canary record buffer; dim 0 indexes slots."""

    name: str
    tensor: torch.Tensor
    group: Group  # FULL: indexed by table-space slots; SWA: by SWA-pool slots
    canary: bool  # canary records (True) or real KV (False)
    layer: int = -1  # KV layer, -1 for canary buffers
    stage: Stage | None = None  # HEAD or TAIL for canary buffers

    @property
    def row_bytes(self) -> int:
        """Bytes of one slot's row."""
        return int(self.tensor[0].numel()) * self.tensor.element_size()

    def describe(self) -> str:
        """Stable description used in the layout digest (both sides must agree on it)."""
        return f"{self.name}:{int(self.group)}:{self.tensor.dtype}:{tuple(self.tensor.shape[1:])}"

    def byte_rows(self) -> torch.Tensor:
        """The tensor viewed as uint8 rows [slots, row_bytes] (a view: writes land in the tensor)."""
        return self.tensor.view(self.tensor.shape[0], -1).view(torch.uint8)


@dataclass(frozen=True)
class Segment:
    """Where one item's rows lie in a payload."""

    offset: int
    rows: int
    nbytes: int


def _align(n: int) -> int:
    return -(-n // SEGMENT_ALIGN) * SEGMENT_ALIGN


class TransferLayout:
    """The ordered item list shared by both roles: HEAD records, KV layers, TAIL records (the TAIL records last)."""

    def __init__(self, items: Sequence[TransferItem]) -> None:
        if not items:
            raise CanaryInputError("a transfer layout needs at least one item")
        device = items[0].tensor.device
        names = set()
        for item in items:
            t = item.tensor
            if t.device != device:
                raise CanaryInputError(f"transfer item {item.name} is on {t.device}, others on {device}")
            if t.dim() < 1 or t.shape[0] == 0 or not t.is_contiguous():
                raise CanaryInputError(f"transfer item {item.name} must be a non-empty contiguous tensor")
            if item.canary != (item.stage is not None):
                raise CanaryInputError(f"transfer item {item.name}: canary buffers (only) carry a stage")
            if item.name in names:
                raise CanaryInputError(f"duplicate transfer item name {item.name}")
            names.add(item.name)
        self.items = tuple(items)
        self.device = device
        self.digest = zlib.crc32("|".join(i.describe() for i in self.items).encode()) & 0x7FFFFFFF

    def rows_of(self, item: TransferItem, full_rows: int, swa_rows: int) -> int:
        """Rows of an item for a request with the given FULL and SWA row counts."""
        return full_rows if item.group == Group.FULL else swa_rows

    def segments(self, full_rows: int, swa_rows: int) -> list[Segment]:
        """Offset, rows and bytes of every item (in order) for one request."""
        out, off = [], 0
        for item in self.items:
            rows = self.rows_of(item, full_rows, swa_rows)
            out.append(Segment(off, rows, rows * item.row_bytes))
            off = _align(off + rows * item.row_bytes)
        return out

    def payload_bytes(self, full_rows: int, swa_rows: int) -> int:
        """Total payload size of one request."""
        segs = self.segments(full_rows, swa_rows)
        return _align(segs[-1].offset + segs[-1].nbytes)

    def split_bytes(self, full_rows: int, swa_rows: int) -> tuple[int, int]:
        """(KV bytes, canary record bytes) of one request, without alignment padding."""
        kv = canary = 0
        for item, seg in zip(self.items, self.segments(full_rows, swa_rows), strict=True):
            if item.canary:
                canary += seg.nbytes
            else:
                kv += seg.nbytes
        return kv, canary

    def row_bytes(self, group: Group) -> tuple[int, int]:
        """(KV bytes, canary record bytes) that one slot of ``group`` adds to a transfer."""
        kv = sum(i.row_bytes for i in self.items if i.group == group and not i.canary)
        return kv, sum(i.row_bytes for i in self.items if i.group == group and i.canary)

    def view(self, buf: torch.Tensor, index: int, full_rows: int, swa_rows: int) -> torch.Tensor:
        """Item ``index``'s rows inside a payload, as uint8 [rows, row_bytes] (a view)."""
        seg = self.segments(full_rows, swa_rows)[index]
        return buf[seg.offset:seg.offset + seg.nbytes].view(seg.rows, self.items[index].row_bytes)

    def gather(self, full_slots: torch.Tensor, swa_slots: torch.Tensor) -> torch.Tensor:
        """Pack the rows of the given slots of every item into one uint8 payload on the layout's device."""
        full_rows, swa_rows = int(full_slots.numel()), int(swa_slots.numel())
        buf = torch.zeros(self.payload_bytes(full_rows, swa_rows), dtype=torch.uint8, device=self.device)
        for i, item in enumerate(self.items):
            slots = full_slots if item.group == Group.FULL else swa_slots
            torch.index_select(item.byte_rows(), 0, slots, out=self.view(buf, i, full_rows, swa_rows))
        return buf

    def scatter(self, buf: torch.Tensor, full_slots: torch.Tensor, swa_slots: torch.Tensor,
                missing: frozenset[int] = frozenset()) -> None:
        """index_copy every delivered item's rows of a payload into the given slots (``missing``: not delivered)."""
        full_rows, swa_rows = int(full_slots.numel()), int(swa_slots.numel())
        if buf.numel() != self.payload_bytes(full_rows, swa_rows):
            raise CanaryInputError(f"payload has {buf.numel()} bytes, layout expects "
                                   f"{self.payload_bytes(full_rows, swa_rows)}")
        for i, item in enumerate(self.items):
            if i in missing:
                continue
            slots = full_slots if item.group == Group.FULL else swa_slots
            item.byte_rows().index_copy_(0, slots, self.view(buf, i, full_rows, swa_rows))
