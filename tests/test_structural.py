"""The structural write check (docs/ops-contract.md 5): hand vectors in every backend, SWA, bad plan rows."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from kvcanary.ops.plan import plan_forward
from kvcanary.ops.types import GroupView, Sink
from kvcanary.ops.write import write
from kvcanary_schema import (
    NO_SLOT,
    NUM_PLAN_COLS,
    NUM_PLAN_STATUS_COLS,
    SKIP_TOKEN,
    CounterCol,
    FailReason,
    Group,
    LaunchTag,
    PlanCol,
    PlanFlag,
    PlanStatusCol,
    Stage,
    ViolationCol,
    WriteCheck,
)

from bench.bench_cpu import write_loop

BACKENDS = ("torch", "cpu", "loop")
S = int(WriteCheck.STRUCTURAL)
PAD_ROW = 2


def run(backend: str, group: GroupView, plan: torch.Tensor, status: torch.Tensor, table: torch.Tensor,
        ids: list[int], pos: list[int], loc: list[int], checks: int = S) -> tuple[torch.Tensor, Sink]:
    g = GroupView(group.records.clone(), group.group, group.reserved_slots, group.swa_map)
    sink = Sink.allocate(32)
    sink.step[0] = 4
    i, p, lc = (torch.tensor(x, dtype=torch.int64) for x in (ids, pos, loc))
    if backend == "loop":
        write_loop(g, Stage.HEAD, plan, status, i, p, lc, sink, checks=checks, table=table)
    else:
        write(g, Stage.HEAD, plan, status, table, i, p, lc, sink, checks=checks, backend=backend)
    return g.records, sink


def rows_of(sink: Sink) -> list[list[int]]:
    return sink.rows[: int(sink.count[0])].tolist()


def structural_row(tag: int, slot: int, expected: int, position: int, stored_pos: int, batch_index: int, row: int,
                   token: int) -> list[int]:
    r = [0] * len(ViolationCol)
    r[ViolationCol.TAG], r[ViolationCol.REASONS] = tag, int(FailReason.STRUCTURAL)
    r[ViolationCol.SLOT], r[ViolationCol.EXPECTED_SLOT], r[ViolationCol.POSITION] = slot, expected, position
    r[ViolationCol.STORED_POSITION], r[ViolationCol.BATCH_INDEX], r[ViolationCol.REQ_ROW] = stored_pos, batch_index, row
    r[ViolationCol.STORED_TOKEN], r[ViolationCol.EXPECTED_TOKEN], r[ViolationCol.STEP] = token, SKIP_TOKEN, 4
    return r


def hand_batch(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int], list[int]]:
    """Request A (row 0, prefix 2, 3 new), padding, request B (row 1, prefix 5, 1 new), padding x3.

    A's second token writes free slot 30 instead of 13; padding writes the reserved slot 1, B's live slot 21, nothing
    (-1) and the out-of-range value 45.
    """
    plan = torch.zeros(8, NUM_PLAN_COLS, dtype=torch.int64)
    status = torch.zeros(NUM_PLAN_STATUS_COLS, dtype=torch.int64)
    plan_forward(plan, status, torch.tensor([0, PAD_ROW, 1, PAD_ROW, PAD_ROW, PAD_ROW]),
                 torch.tensor([2, 0, 5, 0, 0, 0]), torch.tensor([3, 1, 1, 1, 1, 1]), table, 8, padding_row=PAD_ROW)
    assert int(status[PlanStatusCol.NUM_SEGMENTS]) == 6
    assert [int(f) & PlanFlag.PADDING != 0 for f in plan[:6, PlanCol.FLAGS]] == [False, True, False, True, True, True]
    ids = [100, 101, 102, 7, 200, 8, 9, 10]
    pos = [2, 3, 4, 0, 5, 0, 0, 0]
    loc = [12, 30, 14, 1, 25, 21, -1, 45]
    return plan, status, ids, pos, loc


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("i32", [False, True])
def test_hand_vector_full_group(backend: str, i32: bool) -> None:
    table = torch.tensor([list(range(10, 18)), list(range(20, 28)), [NO_SLOT] * 8],
                         dtype=torch.int32 if i32 else torch.int64)
    group = GroupView(torch.zeros(40, 2, 4, dtype=torch.int64), reserved_slots=2)
    plan, status, ids, pos, loc = hand_batch(table)
    rec, sink = run(backend, group, plan, status, table, ids, pos, loc)
    k = int(LaunchTag.HEAD_K_FULL)
    assert Counter(map(tuple, rows_of(sink))) == Counter(map(tuple, [
        structural_row(k, 30, 13, 3, 3, 0, 0, 101),
        structural_row(k, 21, NO_SLOT, 0, 0, 3, PAD_ROW, 8),
        structural_row(k, 45, NO_SLOT, 0, 0, 5, PAD_ROW, 10)]))
    # the misplaced write is still performed (records follow the real KV); padding writes nothing anywhere
    written = (rec != 0).any(2).any(1).nonzero().flatten().tolist()
    assert written == [12, 14, 25, 30]
    for tag in (LaunchTag.HEAD_K_FULL, LaunchTag.HEAD_V_FULL):
        c = sink.counters[tag].tolist()
        assert c[CounterCol.ENTRIES_WRITTEN] == 4 and c[CounterCol.INPUT_ERRORS] == 0
    assert sink.counters[LaunchTag.HEAD_K_FULL, CounterCol.VIOLATIONS] == 3
    assert sink.counters[LaunchTag.HEAD_V_FULL, CounterCol.VIOLATIONS] == 0
    # without the check: the same records, no row
    rec0, sink0 = run(backend, group, plan, status, table, ids, pos, loc, checks=0)
    assert torch.equal(rec0, rec) and int(sink0.count[0]) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_swa_group_compares_in_table_space_and_resolves_padding_through_the_map(backend: str) -> None:
    table = torch.tensor([list(range(10, 18)), list(range(20, 28)), [NO_SLOT] * 8])
    swa_map = torch.full((40,), NO_SLOT, dtype=torch.int64)
    swa_map[:2] = torch.arange(2)  # reserved
    swa_map[10:18] = torch.arange(2, 10)
    swa_map[20:28] = torch.arange(10, 18)
    swa_map[21] = NO_SLOT  # B's slot 21 has left the window: a padding write there lands in no SWA slot
    swa_map[30] = 18
    group = GroupView(torch.zeros(20, 1, 4, dtype=torch.int64), Group.SWA, reserved_slots=2, swa_map=swa_map)
    plan, status, ids, pos, loc = hand_batch(table)
    _, sink = run(backend, group, plan, status, table, ids, pos, loc)
    k = int(LaunchTag.HEAD_K_SWA)
    # slot 21 is evicted in this group (silent here, the FULL group reports it); 45 is outside the map: reported
    assert Counter(map(tuple, rows_of(sink))) == Counter(map(tuple, [
        structural_row(k, 30, 13, 3, 3, 0, 0, 101),
        structural_row(k, 45, NO_SLOT, 0, 0, 5, PAD_ROW, 10)]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_unresolvable_seed_is_still_checked_and_bad_plan_rows_are_not_read(backend: str) -> None:
    table = torch.arange(20, 36, dtype=torch.int64).view(2, 8)
    group = GroupView(torch.zeros(40, 1, 4, dtype=torch.int64), reserved_slots=1)
    plan = torch.zeros(4, NUM_PLAN_COLS, dtype=torch.int64)
    status = torch.zeros(NUM_PLAN_STATUS_COLS, dtype=torch.int64)
    plan_forward(plan, status, torch.tensor([0]), torch.tensor([3]), torch.tensor([2]), table, 2)
    plan[0, PlanCol.SEED_SLOT] = 99  # the segment is not written, but its slots are still checked
    for r, (row, pre) in enumerate([(7, 0), (-1, 0), (1, 50)], start=1):  # cells outside the table: not checked
        plan[r] = plan[0]
        plan[r, PlanCol.ROW], plan[r, PlanCol.PREFIX_LEN] = row, pre
        plan[r, PlanCol.FLAGS] = int(PlanFlag.SEED_IS_HEAD)
    status[PlanStatusCol.NUM_SEGMENTS] = 4
    _, sink = run(backend, group, plan, status, table, [5, 6], [3, 4], [23, 39])
    rows = rows_of(sink)
    by_reason = Counter(r[ViolationCol.REASONS] for r in rows)
    assert by_reason == {int(FailReason.INPUT_ERROR): 1, int(FailReason.STRUCTURAL): 1}
    s = next(r for r in rows if r[ViolationCol.REASONS] == FailReason.STRUCTURAL)
    assert (s[ViolationCol.SLOT], s[ViolationCol.EXPECTED_SLOT], s[ViolationCol.POSITION]) == (39, 24, 4)
