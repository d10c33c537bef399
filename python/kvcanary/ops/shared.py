"""Torch-reference helpers shared by plan, verify and write: slot tables, slot resolution, record links, rows."""

from __future__ import annotations

import torch
from kvcanary_schema import (
    NO_SLOT,
    NUM_LAUNCH_TAGS,
    NUM_VIOLATION_COLS,
    SKIP_TOKEN,
    CounterCol,
    RecordField,
    ViolationCol,
)

from kvcanary.ops import hashes as H
from kvcanary.ops.types import GroupView, Sink

# Slot resolution outcomes (csrc/core/resolve.cuh SlotStatus).
OK, INPUT_ERROR, EVICTED, RESERVED = 0, 1, 2, 3


def resolve_slots(group: GroupView, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(outcome, slot) per table-space slot (csrc/core/resolve.cuh): slot is the group slot, or the bad value."""
    n = group.num_slots
    if group.swa_map is None:
        bad = (t < 0) | (t >= n)
        slot = t
        evicted = torch.zeros_like(bad)
    else:
        m = group.swa_map.shape[0]
        out_of_map = (t < 0) | (t >= m)
        g = group.swa_map[torch.clamp(t, 0, m - 1)] if m else torch.full_like(t, NO_SLOT)
        slot = torch.where(out_of_map, t, g)
        evicted = ~out_of_map & (g < 0)
        bad = out_of_map | (~evicted & (g >= n))
    reserved = ~bad & ~evicted & (slot < group.reserved_slots)
    outcome = torch.full_like(t, OK)
    outcome = torch.where(bad, INPUT_ERROR, torch.where(evicted, EVICTED, torch.where(reserved, RESERVED, outcome)))
    return outcome, slot


def table_slots(flat: torch.Tensor, stride: int, page: int, row: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """Slots of positions ``col`` of rows ``row`` (in range) in a flattened int64 slot table of ``stride`` entries per
    row and ``page`` slots per entry: ``b * page + col % page`` for block id ``b >= 0``, else ``b`` itself
    (docs/ops-contract.md 0, csrc/core/resolve.cuh ``SlotTable::at``)."""
    if page == 1:
        return flat[row * stride + col]
    b = flat[row * stride + torch.div(col, page, rounding_mode="floor")]
    return torch.where(b >= 0, b * page + col % page, b)


def record_link(rec: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(has_link, link) of records [E, RECORD_NUM_FIELDS]: prev_hash * CHAIN_BASE + g(token, position)."""
    tok, pos = rec[:, RecordField.TOKEN], rec[:, RecordField.POSITION]
    ok = H.chain_value_ok(tok) & H.chain_value_ok(pos)
    return ok, H.chain_step(rec[:, RecordField.PREV_HASH], tok, pos)


def violation_rows(n: int, device: torch.device) -> torch.Tensor:
    """n zeroed violation rows with EXPECTED_TOKEN = SKIP_TOKEN and EXPECTED_SLOT = NO_SLOT."""
    r = torch.zeros(n, NUM_VIOLATION_COLS, dtype=torch.int64, device=device)
    r[:, ViolationCol.EXPECTED_TOKEN] = SKIP_TOKEN
    r[:, ViolationCol.EXPECTED_SLOT] = NO_SLOT
    return r


def append_rows(sink: Sink, rows: torch.Tensor) -> None:
    """Append rows to the ring (exact count, first-capacity rows kept) and count VIOLATIONS per tag."""
    n = rows.shape[0]
    if n == 0:
        return
    rows[:, ViolationCol.STEP] = sink.step[0]
    sink.counters[:, CounterCol.VIOLATIONS] += torch.bincount(rows[:, ViolationCol.TAG], minlength=NUM_LAUNCH_TAGS)
    k0 = int(sink.count.item())
    keep = max(0, min(n, sink.capacity - k0))
    if keep:
        sink.rows[k0:k0 + keep] = rows[:keep]
    sink.count += n
