"""Write op: Python-int vectors, torch vs C++ CPU vs a per-entry Python loop, invariants, input errors, bad args."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcanary import _native
from kvcanary.errors import CanaryInputError
from kvcanary.ops import hashes as H
from kvcanary.ops.fingerprint import fingerprint as fp_op
from kvcanary.ops.plan import plan_forward
from kvcanary.ops.types import Fingerprint, FingerprintSources, GroupView, Sink, SourceSpec, TokenPool
from kvcanary.ops.write import (
    bind_write,
    powers,
    takes_carries,
    write,
    write_carries,
    write_target,
    write_workspace,
)
from kvcanary.truth import ChainHasher
from kvcanary_schema import (
    NO_SLOT,
    NUM_CARRY_COLS,
    NUM_PLAN_COLS,
    NUM_PLAN_STATUS_COLS,
    TOKEN_LIMIT,
    CarryHeaderCol,
    CounterCol,
    FailReason,
    FingerprintMode,
    Group,
    LaunchTag,
    PlanCol,
    PlanFlag,
    PlanStatusCol,
    RecordField,
    Stage,
    ViolationCol,
    WriteCheck,
)

from bench.bench_cpu import write_loop

BACKENDS = ["torch", "cpu"]
ALL_CHECKS = int(WriteCheck.CHAIN_POSITION | WriteCheck.INPUTS)


def chain_ints(tokens: list[int], first_pos: int = 0, h: int = H.CHAIN_H0) -> list[int]:
    """prev_hash (u64) of each token of a history, and the value after it, with Python ints."""
    out = []
    for i, t in enumerate(tokens):
        out.append(h)
        h = H.chain_step_int(h, t, first_pos + i)
    return out + [h]


def new_plan(cap: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(cap, NUM_PLAN_COLS, dtype=torch.int64), torch.zeros(NUM_PLAN_STATUS_COLS, dtype=torch.int64)


# ---- hand vectors ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_five_token_chain_records_equal_python_ints(backend: str) -> None:
    toks = [11, 22, 33, 44, 55]
    rec = torch.zeros(16, 2, 4, dtype=torch.int64)
    table = torch.arange(16, dtype=torch.int32).flip(0).view(1, 16).contiguous()  # slots 15, 14, ...
    plan, status = new_plan()
    plan_forward(plan, status, torch.tensor([0]), torch.tensor([0]), torch.tensor([5]), table, 5)
    sink = Sink.allocate(8)
    write(GroupView(rec), Stage.HEAD, plan, status, table, torch.tensor(toks), torch.arange(5),
          table[0, :5].long(), sink, checks=ALL_CHECKS, backend=backend)
    hs = chain_ints(toks)
    for j in range(5):
        for h in range(2):
            assert rec[15 - j, h].tolist() == [toks[j], j, H.to_i64(hs[j]), 0]
    assert int(rec[:11].abs().sum()) == 0
    assert int(sink.count[0]) == 0
    for tag in (LaunchTag.HEAD_K_FULL, LaunchTag.HEAD_V_FULL):
        assert sink.counters[tag, CounterCol.WRITE_RUNS] == 1
        assert sink.counters[tag, CounterCol.ENTRIES_WRITTEN] == 5
    assert int(sink.counters.sum()) == 12


@pytest.mark.parametrize("backend", BACKENDS)
def test_seeded_continuation_equals_one_write(backend: str) -> None:
    toks = [7, 8, 9, 10, 11, 12, 13]
    table = torch.arange(10, dtype=torch.int64).view(1, 10)
    one = torch.zeros(10, 1, 4, dtype=torch.int64)
    two = torch.zeros(10, 1, 4, dtype=torch.int64)
    sink = Sink.allocate(8)
    plan, status = new_plan()
    plan_forward(plan, status, torch.tensor([0]), torch.tensor([0]), torch.tensor([7]), table, 7)
    write(GroupView(one), Stage.TAIL, plan, status, table, torch.tensor(toks), torch.arange(7), table[0, :7], sink,
          backend=backend)
    for pre, ext in ((0, 3), (3, 1), (4, 3)):
        plan_forward(plan, status, torch.tensor([0]), torch.tensor([pre]), torch.tensor([ext]), table, ext)
        write(GroupView(two), Stage.TAIL, plan, status, table, torch.tensor(toks[pre:pre + ext]),
              torch.arange(pre, pre + ext), table[0, pre:pre + ext], sink, checks=ALL_CHECKS, backend=backend)
    assert torch.equal(one, two)
    assert one[:7, 0, RecordField.PREV_HASH].tolist() == [H.to_i64(v) for v in chain_ints(toks)[:7]]
    assert int(sink.count[0]) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_skips_are_identity_and_reserved_slots_are_written(backend: str) -> None:
    # FULL: tokens 0..5 with loc -1 (padding) at j=1, a bad slot at j=2, a bad token at j=3, a reserved slot at j=4.
    rec = torch.zeros(20, 1, 4, dtype=torch.int64)
    group = GroupView(rec, reserved_slots=2)
    table = torch.arange(20, dtype=torch.int64).view(1, 20)
    toks, pos = [5, 6, 7, -1, 9, 10], [0, 1, 2, 3, 4, 5]
    loc = [10, -1, 99, 13, 1, 15]
    plan, status = new_plan()
    plan_forward(plan, status, torch.tensor([0]), torch.tensor([0]), torch.tensor([6]), table, 6)
    sink = Sink.allocate(8)
    write(group, Stage.HEAD, plan, status, table, torch.tensor(toks), torch.tensor(pos), torch.tensor(loc), sink,
          checks=int(WriteCheck.CHAIN_POSITION), backend=backend)
    hs = chain_ints([5, 9, 10], 0)  # the chain skips j = 1, 2, 3 (positions are the written ones)
    h = H.CHAIN_H0
    h1 = H.chain_step_int(h, 5, 0)
    h2 = H.chain_step_int(h1, 9, 4)
    assert rec[10, 0].tolist() == [5, 0, H.to_i64(hs[0]), 0]
    assert rec[1, 0].tolist() == [9, 4, H.to_i64(h1), 0]  # reserved slot: written
    assert rec[15, 0].tolist() == [10, 5, H.to_i64(h2), 0]
    assert int(rec[13].abs().sum()) == 0
    tag = LaunchTag.HEAD_K_FULL
    c = sink.counters[tag].tolist()
    assert c[CounterCol.ENTRIES_WRITTEN] == 3 and c[CounterCol.INPUT_ERRORS] == 2 and c[CounterCol.SKIPPED] == 0
    rows = sink.rows[: int(sink.count[0])]
    by_reason = Counter((int(r[ViolationCol.REASONS]), int(r[ViolationCol.SLOT])) for r in rows)
    # chain-position assert: position 4 after 0 (j = 4 at the reserved slot) is not previous + 1.
    assert by_reason == Counter({(int(FailReason.INPUT_ERROR), 99): 1, (int(FailReason.INPUT_ERROR), 13): 1,
                                 (int(FailReason.WRITE_POSITION), 1): 1})


@pytest.mark.parametrize("backend", BACKENDS)
def test_swa_translation_eviction_and_bad_map_values(backend: str) -> None:
    swa_map = torch.tensor([3, 4, -1, 5, 50, 6, 7, 8], dtype=torch.int64)  # table slot 2 evicted, 4 -> bad 50
    rec = torch.zeros(10, 2, 4, dtype=torch.int64)
    group = GroupView(rec, group=Group.SWA, swa_map=swa_map)
    table = torch.arange(8, dtype=torch.int64).view(1, 8)
    plan, status = new_plan()
    plan_forward(plan, status, torch.tensor([0]), torch.tensor([0]), torch.tensor([6]), table, 6, window=4)
    sink = Sink.allocate(8)
    toks = [1, 2, 3, 4, 5, 6]
    write(group, Stage.TAIL, plan, status, table, torch.tensor(toks), torch.arange(6), table[0, :6], sink,
          backend=backend)
    h0 = H.CHAIN_H0
    h1 = H.chain_step_int(h0, 1, 0)
    h2 = H.chain_step_int(h1, 2, 1)
    h3 = H.chain_step_int(h2, 4, 3)
    assert rec[3, :, RecordField.PREV_HASH].tolist() == [H.to_i64(h0)] * 2
    assert rec[4, :, RecordField.PREV_HASH].tolist() == [H.to_i64(h1)] * 2
    assert rec[5, :, RecordField.PREV_HASH].tolist() == [H.to_i64(h2)] * 2
    assert rec[6, :, RecordField.PREV_HASH].tolist() == [H.to_i64(h3)] * 2  # table slot 4 (bad) was skipped
    for tag in (LaunchTag.TAIL_K_SWA, LaunchTag.TAIL_V_SWA):
        c = sink.counters[tag].tolist()
        assert (c[CounterCol.ENTRIES_WRITTEN], c[CounterCol.SKIPPED], c[CounterCol.INPUT_ERRORS]) == (4, 1, 1)
    rows = sink.rows[: int(sink.count[0])]
    assert sorted(rows[:, ViolationCol.TAG].tolist()) == [LaunchTag.TAIL_K_SWA, LaunchTag.TAIL_V_SWA]
    assert rows[:, ViolationCol.SLOT].tolist() == [50, 50]
    assert rows[:, ViolationCol.POSITION].tolist() == [4, 4]


@pytest.mark.parametrize("backend", BACKENDS)
def test_unresolvable_seed_skips_the_whole_segment(backend: str) -> None:
    rec = torch.zeros(12, 2, 4, dtype=torch.int64)
    rec[3, 0] = torch.tensor([-1, 2, 0, 0])  # K seed record with a bad token; V seed record fine
    rec[3, 1] = torch.tensor([5, 2, 123, 0])
    table = torch.arange(12, dtype=torch.int64).view(1, 12)
    plan, status = new_plan()
    plan_forward(plan, status, torch.tensor([0]), torch.tensor([4]), torch.tensor([2]), table, 2)
    assert plan[0, PlanCol.SEED_SLOT] == 3
    sink = Sink.allocate(8)
    write(GroupView(rec), Stage.HEAD, plan, status, table, torch.tensor([8, 9]), torch.tensor([4, 5]),
          table[0, 4:6], sink, backend=backend)
    assert int(rec[4:6, 0].abs().sum()) == 0  # K: not written
    h_seed = H.chain_step_int(123, 5, 2)
    assert rec[4, 1].tolist() == [8, 4, H.to_i64(h_seed), 0]  # V: seeded from its own record
    rows = sink.rows[: int(sink.count[0])].tolist()
    assert len(rows) == 1
    r = rows[0]
    assert (r[ViolationCol.TAG], r[ViolationCol.REASONS], r[ViolationCol.SLOT], r[ViolationCol.POSITION]) == \
        (LaunchTag.HEAD_K_FULL, FailReason.INPUT_ERROR, 3, 3)
    assert sink.counters[LaunchTag.HEAD_K_FULL, CounterCol.INPUT_ERRORS] == 1
    assert sink.counters[LaunchTag.HEAD_K_FULL, CounterCol.ENTRIES_WRITTEN] == 0
    assert sink.counters[LaunchTag.HEAD_V_FULL, CounterCol.ENTRIES_WRITTEN] == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_input_assert_and_pool_with_offset(backend: str) -> None:
    rec = torch.zeros(12, 1, 4, dtype=torch.int64)
    table = torch.arange(12, dtype=torch.int64).view(1, 12)
    truth = [100, 101, 102, 103, 104, 105]
    pool = TokenPool(torch.tensor([[0] + truth + [0]]), torch.tensor([6]), offset=1)  # pool[0, p + 1] = truth[p]
    plan, status = new_plan()
    plan_forward(plan, status, torch.tensor([0]), torch.tensor([0]), torch.tensor([4]), table, 4)
    sink = Sink.allocate(8)
    # j=1: wrong token; j=2: position 7 instead of 2 (input assert + chain-position assert); j=3 position 3 after 7.
    write(GroupView(rec), Stage.HEAD, plan, status, table, torch.tensor([100, 555, 102, 103]),
          torch.tensor([0, 1, 7, 3]), table[0, :4], sink, checks=ALL_CHECKS, token_pool=pool, backend=backend)
    rows = {int(r[ViolationCol.POSITION]): r for r in sink.rows[: int(sink.count[0])].tolist()}
    assert set(rows) == {1, 2, 3}
    assert rows[1][ViolationCol.REASONS] == FailReason.WRITE_TOKEN
    assert (rows[1][ViolationCol.STORED_TOKEN], rows[1][ViolationCol.EXPECTED_TOKEN]) == (555, 101)
    assert rows[2][ViolationCol.REASONS] == FailReason.WRITE_POSITION
    assert rows[2][ViolationCol.STORED_POSITION] == 7
    assert rows[2][ViolationCol.EXPECTED_TOKEN] == -1  # pool row length 6 does not cover p + 1 = 8
    assert rows[3][ViolationCol.REASONS] == FailReason.WRITE_POSITION  # chain-position only: 3 != 7 + 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_expect_new_from_chain_hasher(backend: str) -> None:
    rec = torch.zeros(30, 1, 4, dtype=torch.int64)
    table = torch.arange(30, dtype=torch.int64).view(2, 15)
    hasher = ChainHasher()
    toks = {0: [3, 1, 4, 1, 5], 1: [2, 7, 1, 8]}
    want = hasher.extend_batch([0, 1], [toks[0], toks[1]], [0, 0])
    want[1] += 1  # request 1 claims another history
    plan, status = new_plan()
    plan_forward(plan, status, torch.tensor([0, 1]), torch.tensor([0, 0]), torch.tensor([5, 4]), table, 9,
                 expect_new=want)
    sink = Sink.allocate(8)
    loc = torch.cat([table[0, :5], table[1, :4]])
    write(GroupView(rec), Stage.HEAD, plan, status, table, torch.tensor(toks[0] + toks[1]),
          torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3]), loc, sink, backend=backend)
    rows = sink.rows[: int(sink.count[0])].tolist()
    assert len(rows) == 1
    r = rows[0]
    assert r[ViolationCol.REASONS] == FailReason.WRITE_TOKEN and r[ViolationCol.BATCH_INDEX] == 1
    assert (r[ViolationCol.SLOT], r[ViolationCol.POSITION], r[ViolationCol.STORED_TOKEN]) == (18, 3, 8)
    assert r[ViolationCol.STORED_HASH] == H.to_i64(hasher.value(1))
    assert r[ViolationCol.EXPECTED_HASH] == int(want[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_plan_rows_are_input_errors(backend: str) -> None:
    rec = torch.zeros(8, 1, 4, dtype=torch.int64)
    table = torch.arange(8, dtype=torch.int64).view(1, 8)
    plan, status = new_plan(4)
    plan[0, PlanCol.WRITE_BEGIN], plan[0, PlanCol.WRITE_LEN], plan[0, PlanCol.PREFIX_LEN] = 2, 5, 9  # past T = 4
    plan[1, PlanCol.WRITE_BEGIN], plan[1, PlanCol.WRITE_LEN] = -1, 1
    plan[2, PlanCol.WRITE_LEN] = -3
    plan[3, PlanCol.WRITE_LEN] = 0  # nothing, no error
    status[PlanStatusCol.NUM_SEGMENTS] = 99  # clamped to the capacity
    sink = Sink.allocate(8)
    write(GroupView(rec), Stage.HEAD, plan, status, table, torch.zeros(4, dtype=torch.int64),
          torch.arange(4), torch.arange(4), sink, backend=backend)
    rows = sink.rows[: int(sink.count[0])]
    assert rows.shape[0] == 3
    assert rows[:, ViolationCol.REASONS].tolist() == [int(FailReason.INPUT_ERROR)] * 3
    assert rows[:, ViolationCol.SLOT].tolist() == [NO_SLOT] * 3
    assert sorted(rows[:, ViolationCol.POSITION].tolist()) == [0, 0, 9]
    assert int(rec.abs().sum()) == 0


# ---- differential fuzz: torch vs cpu vs the per-entry Python loop ----------------------------------------------

@dataclass
class Case:
    group: GroupView
    stage: Stage
    plan: torch.Tensor
    status: torch.Tensor
    table: torch.Tensor
    ids: torch.Tensor
    pos: torch.Tensor
    loc: torch.Tensor
    checks: int
    pool: TokenPool | None
    fp: Fingerprint | None
    written_slots: set[int]


def make_case(seed: int, *, halves: int = 2, swa: bool = False, fp: bool = False, checks: int = ALL_CHECKS,
              pool: bool = True, i32: bool = False, bad: float = 0.1) -> Case:
    rng = random.Random(seed)
    rows_n, width = rng.randrange(2, 9), rng.randrange(4, 40)
    reserved = rng.randrange(0, 3)
    extra = rng.randrange(0, 9)
    table_space = rows_n * width + reserved + extra
    if swa:
        num_slots = rng.randrange(rows_n * width // 2 + reserved + 1, table_space + 2)
        order = list(range(num_slots))
        rng.shuffle(order)
        swa_list = []
        for _ in range(table_space):
            r = rng.random()
            swa_list.append(-1 if r < bad / 2 or not order else num_slots + 5 if r < bad * 0.7 else order.pop())
        swa_map = torch.tensor(swa_list, dtype=torch.int64)
    else:
        num_slots = table_space
        swa_map = None
    perm = list(range(reserved, table_space))
    rng.shuffle(perm)
    table_l = [perm[r * width:(r + 1) * width] for r in range(rows_n)]
    spare = perm[rows_n * width:]  # slots no request owns: a wrong out_cache_loc that collides with no write
    padding_row = rows_n if rng.random() < 0.5 else -1  # an extra table row whose cells are never read
    table = torch.tensor(table_l + ([[NO_SLOT] * width] if padding_row >= 0 else []),
                         dtype=torch.int32 if i32 else torch.int64)
    rec = torch.randint(-2**40, 2**40, (num_slots, halves, 4), generator=torch.Generator().manual_seed(seed))
    group = GroupView(rec, group=Group.SWA if swa else Group.FULL, reserved_slots=reserved, swa_map=swa_map)

    def gslot(t: int) -> int | None:
        g = t if swa_map is None else swa_list[t]
        return g if 0 <= g < num_slots else None

    truth = [[rng.randrange(0, 50_000) for _ in range(width)] for _ in range(rows_n)]
    bs = rng.randrange(1, rows_n + 1)
    req_rows = rng.sample(range(rows_n), bs)
    pre = [rng.randrange(0, width) for _ in range(bs)]
    ext = [rng.randrange(0, width - p + 1) for p in pre]
    # Prefix records written with Python ints (independent of the op); a few seeds corrupted.
    for r, p in zip(req_rows, pre, strict=True):
        hs = chain_ints(truth[r][:p])
        for i in range(p):
            g = gslot(table_l[r][i])
            if g is not None:
                for h in range(halves):
                    rec[g, h] = torch.tensor([truth[r][i], i, H.to_i64(hs[i]), 0])
        if p and rng.random() < bad:
            g = gslot(table_l[r][p - 1])
            if g is not None:
                rec[g, rng.randrange(halves), RecordField.TOKEN] = -5
    ids, pos, loc = [], [], []
    used_reserved: set[int] = set()
    batch = list(zip(req_rows, pre, ext, strict=True))
    n_pad = rng.randrange(0, 3) if padding_row >= 0 else 0
    for _ in range(n_pad):  # padding rows (decode-like, at random batch positions): reserved, live or bad slots
        batch.insert(rng.randrange(len(batch) + 1), (padding_row, rng.randrange(-1, 3), rng.randrange(-1, 3)))
    for r, p, e in batch:
        if r == padding_row:
            for _ in range(max(e, 0)):
                ids.append(rng.randrange(50_000))
                pos.append(rng.randrange(-1, 5))
                loc.append(rng.choice([-1, rng.randrange(0, max(reserved, 1)), rng.randrange(table_space),
                                       table_space + 2]))
            continue
        for j in range(e):
            t, q, lc = truth[r][p + j], p + j, table_l[r][p + j]
            x = rng.random()
            if x < bad * 0.1:
                t = rng.choice([-1, TOKEN_LIMIT])
            elif x < bad * 0.35:
                t = rng.choice([rng.randrange(50_000), t + 1])
            elif x < bad * 0.5:
                q = rng.choice([-1, TOKEN_LIMIT, q + 1, q - 1])
            elif x < bad * 0.7:
                lc = rng.choice([-1, -7, table_space + 3])
            elif x < bad * 0.8 and not swa and reserved > len(used_reserved):
                lc = min(set(range(reserved)) - used_reserved)
                used_reserved.add(lc)
            elif x < bad and spare:  # out_cache_loc disagrees with req_to_token: a slot no request owns
                lc = spare.pop()
            ids.append(t)
            pos.append(q)
            loc.append(lc)
    pad = rng.randrange(0, 3)
    ids += [0] * pad
    pos += [0] * pad
    loc += [-1] * pad
    hasher = ChainHasher()
    want = [H.to_i64(chain_ints(truth[r][:p + e])[-1]) if rng.random() > bad else rng.getrandbits(63)
            for r, p, e in zip(req_rows, pre, ext, strict=True)]
    del hasher
    want_all = [want[req_rows.index(r)] if r != padding_row else 0 for r, _, _ in batch]
    plan, status = new_plan(len(batch) + 3)
    plan_forward(plan, status, torch.tensor([b[0] for b in batch]), torch.tensor([b[1] for b in batch]),
                 torch.tensor([b[2] for b in batch]), table, len(ids), window=rng.choice([0, 3]) if swa else 0,
                 padding_row=padding_row, expect_new=torch.tensor(want_all))
    n = int(status[PlanStatusCol.NUM_SEGMENTS])
    if rng.random() < bad * 3:  # extra bogus rows: a range error and an unresolvable seed (neither writes)
        plan[n] = plan[0]
        plan[n, PlanCol.WRITE_BEGIN] = len(ids)
        plan[n, PlanCol.WRITE_LEN] = 2
        plan[n + 1] = plan[0]
        plan[n + 1, PlanCol.FLAGS] = 0
        plan[n + 1, PlanCol.WRITE_LEN] = max(1, int(plan[0, PlanCol.WRITE_LEN]))
        plan[n + 1, PlanCol.WRITE_BEGIN] = 0
        plan[n + 1, PlanCol.SEED_SLOT] = rng.choice([-3, table_space + 1])
        status[PlanStatusCol.NUM_SEGMENTS] = n + 2
    tp = None
    if pool:
        off = rng.choice([0, 1])
        pt = torch.tensor([[0] * off + tr + [0] for tr in truth], dtype=torch.int64)
        lens = [width + off if rng.random() < 0.7 else rng.randrange(0, width + off + 1) for _ in range(rows_n)]
        tp = TokenPool(pt, torch.tensor(lens), offset=off)
    fpr = None
    if fp:
        gen = torch.Generator().manual_seed(seed + 1)
        srcs = [[SourceSpec(torch.randint(0, 256, ((num_slots + 1) // 2, 2 * 48), dtype=torch.uint8, generator=gen),
                            page_size=2, read_bytes=32) for _ in range(2)] for _ in range(halves)]
        fpr = Fingerprint(FingerprintSources(srcs, num_slots), rng.choice([FingerprintMode.ALL,
                                                                           FingerprintMode.PARTIAL]),
                          layer_stride=rng.choice([1, 2]))
    written = {g for lc in loc if lc >= 0 and lc < table_space and (g := gslot(lc)) is not None}
    return Case(group, rng.choice([Stage.TAIL, Stage.HEAD]) if not fp else Stage.TAIL, plan, status, table,
                torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64),
                torch.tensor(loc, dtype=torch.int64), checks, tp, fpr, written)


def run_case(case: Case, backend: str, cap: int = 4096, workspace: torch.Tensor | None = None,
             checks: int | None = None, carries: torch.Tensor | None = None) -> tuple[torch.Tensor, Sink]:
    rec = case.group.records.clone()
    g = GroupView(rec, case.group.group, case.group.reserved_slots, case.group.swa_map)
    sink = Sink.allocate(cap)
    sink.step[0] = 17
    sink.count[0] = 2  # rows already in the window: appended after them
    if backend == "loop":
        write_loop(g, case.stage, case.plan, case.status, case.ids, case.pos, case.loc, sink, checks=case.checks,
                   token_pool=case.pool, fingerprint=case.fp, table=case.table)
    else:
        write(g, case.stage, case.plan, case.status, case.table, case.ids, case.pos, case.loc, sink,
              checks=case.checks if checks is None else checks, token_pool=case.pool, fingerprint=case.fp,
              workspace=workspace, carries=carries, backend=backend)
    return rec, sink


def ring_rows(sink: Sink) -> Counter[tuple[int, ...]]:
    n = min(int(sink.count[0]), sink.capacity)
    return Counter(tuple(r) for r in sink.rows[2:n].tolist())


def assert_same(case: Case) -> None:
    outs = {b: run_case(case, b) for b in ("torch", "cpu", "loop")}
    rec_t, sink_t = outs["torch"]
    for b in ("cpu", "loop"):
        rec_b, sink_b = outs[b]
        assert torch.equal(rec_t, rec_b), b
        assert torch.equal(sink_t.counters, sink_b.counters), b
        assert int(sink_t.count[0]) == int(sink_b.count[0]), b
        assert ring_rows(sink_t) == ring_rows(sink_b), b
    # Invariant: only slots the batch targets (resolved, non-negative out_cache_loc) may change.
    changed = (rec_t != case.group.records).any(2).any(1).nonzero().flatten().tolist()
    assert set(changed) <= case.written_slots
    assert int(sink_t.count[0]) - 2 == int(sink_t.counters[:, CounterCol.VIOLATIONS].sum())


@pytest.mark.parametrize("seed", range(40))
def test_fuzz_torch_cpu_loop_agree(seed: int) -> None:
    rng = random.Random(1000 + seed)
    assert_same(make_case(seed, halves=rng.choice([1, 2]), swa=rng.random() < 0.4, fp=rng.random() < 0.3,
                          checks=rng.choice(range(8)), pool=rng.random() < 0.6, i32=rng.random() < 0.5,
                          bad=rng.choice([0.0, 0.1, 0.3])))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), halves=st.sampled_from([1, 2]), swa=st.booleans(), fp=st.booleans(),
       checks=st.integers(0, 7), pool=st.booleans(), i32=st.booleans(), bad=st.sampled_from([0.0, 0.05, 0.2, 0.5]))
def test_property_torch_cpu_loop_agree(seed: int, halves: int, swa: bool, fp: bool, checks: int, pool: bool,
                                       i32: bool, bad: float) -> None:
    assert_same(make_case(seed, halves=halves, swa=swa, fp=fp, checks=checks, pool=pool, i32=i32, bad=bad))


@pytest.mark.parametrize("seed", range(6))
def test_clean_batches_raise_nothing_and_match_the_hasher(seed: int) -> None:
    case = make_case(seed, halves=2, fp=True, bad=0.0)
    for backend in BACKENDS:
        rec, sink = run_case(case, backend)
        assert int(sink.count[0]) == 2, backend
        # Every written record's prev_hash is the true chain value at its position, fingerprint = fresh one.
        segs = case.plan[: int(case.status[PlanStatusCol.NUM_SEGMENTS])]
        for seg in segs.tolist():
            if seg[PlanCol.FLAGS] & PlanFlag.PADDING:
                continue  # padding rows write no records
            toks = case.ids[seg[PlanCol.WRITE_BEGIN]: seg[PlanCol.WRITE_BEGIN] + seg[PlanCol.WRITE_LEN]].tolist()
            slots = case.loc[seg[PlanCol.WRITE_BEGIN]: seg[PlanCol.WRITE_BEGIN] + seg[PlanCol.WRITE_LEN]]
            pre = seg[PlanCol.PREFIX_LEN]
            hasher = ChainHasher()
            row_truth = [int(case.pool.tokens[seg[PlanCol.ROW], i + case.pool.offset]) for i in range(pre)] \
                if case.pool else None
            assert row_truth is not None
            hasher.extend("r", row_truth, 0)
            for j, t in enumerate(toks):
                assert int(rec[slots[j], 0, RecordField.PREV_HASH]) == H.to_i64(hasher.value("r"))
                hasher.extend("r", [t], pre + j)
            assert case.fp is not None
            fresh = fp_op(case.fp.sources, 1, slots, torch.arange(pre, pre + len(toks)), case.fp.mode,
                          case.fp.layer_stride)
            assert torch.equal(rec[slots, 1, RecordField.KV_FINGERPRINT], fresh)


def test_ring_overflow_keeps_exact_counts() -> None:
    seed = 0
    while True:  # the first seeded case with more rows than the small ring keeps
        case = make_case(seed, halves=2, bad=0.5)
        _, sink_full = run_case(case, "torch")
        total = int(sink_full.count[0])
        if total > 8:
            break
        seed += 1
    for backend in BACKENDS:
        _, sink = run_case(case, backend, cap=5)
        assert int(sink.count[0]) == total
        assert torch.equal(sink.counters, sink_full.counters)
        kept = Counter(tuple(r) for r in sink.rows[2:5].tolist())
        assert not kept - ring_rows(sink_full)


# ---- properties of the chain -----------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(toks=st.lists(st.integers(0, TOKEN_LIMIT - 1), min_size=2, max_size=40), data=st.data())
def test_single_substitution_changes_every_later_chain_value(toks: list[int], data: st.DataObject) -> None:
    n = len(toks)
    i = data.draw(st.integers(0, n - 1))
    what = data.draw(st.sampled_from(["token", "position"]))
    pos = list(range(n))
    toks2, pos2 = list(toks), list(pos)
    if what == "token":
        toks2[i] = data.draw(st.integers(0, TOKEN_LIMIT - 1).filter(lambda t: t != toks[i]))
    else:
        pos2[i] = data.draw(st.integers(0, TOKEN_LIMIT - 1).filter(lambda p: p != i))
    table = torch.arange(n, dtype=torch.int64).view(1, n)
    plan, status = new_plan()
    plan_forward(plan, status, torch.tensor([0]), torch.tensor([0]), torch.tensor([n]), table, n)
    outs = []
    for t, p in ((toks, pos), (toks2, pos2)):
        rec = torch.zeros(n, 1, 4, dtype=torch.int64)
        write(GroupView(rec), Stage.HEAD, plan, status, table, torch.tensor(t), torch.tensor(p), table[0],
              Sink.allocate(4), backend=data.draw(st.sampled_from(BACKENDS)))
        outs.append(rec[:, 0, RecordField.PREV_HASH])
    assert torch.equal(outs[0][: i + 1], outs[1][: i + 1])
    assert bool((outs[0][i + 1:] != outs[1][i + 1:]).all())


def test_powers_wrap_like_python_ints() -> None:
    b = 0x9E3779B97F4A7C15
    got = powers(b, 70, torch.device("cpu")).tolist()
    assert got == [H.to_i64(pow(b, k, 1 << 64)) for k in range(70)]


# ---- bad arguments ---------------------------------------------------------------------------------------------

def _args() -> dict[str, object]:
    rec = torch.zeros(8, 2, 4, dtype=torch.int64)
    table = torch.arange(8, dtype=torch.int64).view(1, 8)
    plan, status = new_plan()
    return {"group": GroupView(rec), "stage": Stage.HEAD, "plan": plan, "status": status, "table": table,
            "input_ids": torch.zeros(3, dtype=torch.int64), "positions": torch.arange(3),
            "out_cache_loc": torch.arange(3), "sink": Sink.allocate(4)}


@pytest.mark.parametrize(("change", "match"), [
    ({"stage": Stage.SWEEP}, "stage"),
    ({"input_ids": torch.zeros(3, dtype=torch.int32)}, "input_ids"),
    ({"positions": torch.arange(4)}, "positions"),
    ({"out_cache_loc": torch.arange(6)[::2]}, "out_cache_loc"),
    ({"plan": torch.zeros(4, 3, dtype=torch.int64)}, "plan"),
    ({"status": torch.zeros(2, dtype=torch.int64)}, "status"),
    ({"table": torch.zeros(8, dtype=torch.int64)}, "table"),
    ({"table": torch.zeros(1, 8, dtype=torch.float32)}, "table"),
    ({"sink": "sink"}, "sink"),
    ({"checks": 2 * max(int(c) for c in WriteCheck)}, "checks"),
    ({"checks": int(WriteCheck.RECORD_CARRIES)}, "carries tensor"),
    ({"checks": int(WriteCheck.REUSE_CARRIES | WriteCheck.RECORD_CARRIES), "carries": write_carries(4, "cpu")},
     "exclude"),
    ({"checks": int(WriteCheck.REUSE_CARRIES), "carries": torch.zeros(5, 4, dtype=torch.int64)}, "carries"),
    ({"carries": torch.zeros(0, NUM_CARRY_COLS, dtype=torch.int64)}, "header row"),
    ({"carries": write_carries(4, "cpu").int()}, "carries"),
    ({"checks": -1}, "checks"),
    ({"token_pool": "pool"}, "token_pool"),
    ({"backend": "tpu"}, "backend"),
    ({"workspace": torch.zeros(2, 3, dtype=torch.int64)}, "workspace"),
    ({"workspace": torch.zeros(8, dtype=torch.int32)}, "workspace"),
    ({"backend": "cuda"}, "cuda"),
])
def test_wrapper_rejects_bad_arguments(change: dict[str, object], match: str) -> None:
    args = _args()
    args.update(change)
    with pytest.raises(CanaryInputError, match=match):
        write(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_shared_target_binds_each_shape_as_a_fresh_bind(backend: str) -> None:
    """One write_target (checked and, natively, converted once) bound at several token counts writes what a fresh
    bind_write of each writes; the per-shape arguments are still checked."""
    case = make_case(5, fp=True)
    n = case.ids.shape[0]
    outs = []
    for shared in (True, False):
        g = GroupView(case.group.records.clone(), case.group.group, case.group.reserved_slots, case.group.swa_map)
        sink = Sink.allocate(4096)
        target = write_target(g, case.stage, case.status, case.table, sink, checks=case.checks,
                              token_pool=case.pool, fingerprint=case.fp, backend=backend).frozen()
        for k in (n // 2, n, 0):
            tokens = (case.ids[:k], case.pos[:k], case.loc[:k])
            op = target.bind(case.plan, *tokens) if shared else bind_write(
                g, case.stage, case.plan, case.status, case.table, *tokens, sink, checks=case.checks,
                token_pool=case.pool, fingerprint=case.fp, backend=backend)
            op.frozen()(case.table)
        outs.append((g.records, ring_rows(sink), sink.counters))
    assert torch.equal(outs[0][0], outs[1][0]) and outs[0][1] == outs[1][1] and torch.equal(outs[0][2], outs[1][2])
    for bad, match in (((torch.zeros(4, 3, dtype=torch.int64), case.ids, case.pos, case.loc), "plan"),
                       ((case.plan, case.ids, case.pos[:-1], case.loc), "positions"),
                       ((case.plan, case.ids.float(), case.pos, case.loc), "input_ids")):
        with pytest.raises(CanaryInputError, match=match):
            target.bind(*bad)


def test_fingerprint_rejected_when_too_small() -> None:
    args = _args()
    args["stage"] = Stage.TAIL
    small = FingerprintSources([[SourceSpec(torch.zeros(4, 32, dtype=torch.uint8))]] * 2, num_slots=4)
    with pytest.raises(CanaryInputError, match="slots"):
        write(**args, fingerprint=Fingerprint(small))  # type: ignore[arg-type]
    one_half = FingerprintSources([[SourceSpec(torch.zeros(8, 32, dtype=torch.uint8))]], num_slots=8)
    with pytest.raises(CanaryInputError, match="halves"):
        write(**args, fingerprint=Fingerprint(one_half))  # type: ignore[arg-type]


def test_native_entry_rejects_bad_arguments() -> None:
    mod = _native.module("cpu")
    a = _args()
    sink = a["sink"]
    assert isinstance(sink, Sink)
    e = torch.empty(0, dtype=torch.int64)

    def call(**kw: object) -> None:
        v: dict[str, object] = {"records": a["group"].records, "swa_map": e, "is_swa": 0,  # type: ignore[attr-defined]
                                "reserved": 0, "tag0": 0, "tag1": 1, "plan": a["plan"], "status": a["status"],
                                "table": a["table"], "ids": a["input_ids"], "pos": a["positions"],
                                "loc": a["out_cache_loc"], "rows": sink.rows, "count": sink.count,
                                "counters": sink.counters, "step": sink.step, "checks": 0, "pt": e, "pl": e,
                                "has_pool": 0, "off": 0, "fpt": e, "mode": 0, "stride": 1, "page": 1, "ws": e,
                                "carries": e}
        v.update(kw)
        mod.write(*v.values())

    call()
    with pytest.raises(ValueError, match="reserved_slots"):
        call(reserved=9)
    with pytest.raises(ValueError, match="page size"):
        call(page=0)
    with pytest.raises(ValueError, match="launch tag"):
        call(tag1=12)
    with pytest.raises(TypeError, match="int64"):
        call(ids=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(TypeError, match="workspace"):
        call(ws=torch.zeros(8, dtype=torch.int32))
    with pytest.raises(ValueError, match="workspace"):
        call(ws=torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="shape"):
        call(pos=torch.arange(4))
    with pytest.raises(ValueError, match="plan"):
        call(plan=torch.zeros(4, 5, dtype=torch.int64))
    with pytest.raises(TypeError, match="table"):
        call(table=torch.zeros(1, 8, dtype=torch.float32))
    with pytest.raises(ValueError, match="fp_layer_stride"):
        call(mode=int(FingerprintMode.ALL), stride=0)
    with pytest.raises(ValueError, match="fingerprint mode"):
        call(mode=5)
    with pytest.raises(ValueError, match="pool_lens"):
        call(has_pool=1, pt=torch.zeros(2, 4, dtype=torch.int64), pl=torch.zeros(3, dtype=torch.int64))
    record, reuse = int(WriteCheck.RECORD_CARRIES), int(WriteCheck.REUSE_CARRIES)
    call(checks=reuse, carries=write_carries(3, "cpu"))
    with pytest.raises(ValueError, match="exclude"):
        call(checks=record | reuse, carries=write_carries(3, "cpu"))
    with pytest.raises(ValueError, match="carries must have 2 dims"):
        call(checks=record)
    with pytest.raises(ValueError, match="carries must be"):
        call(checks=record, carries=torch.zeros(3, NUM_CARRY_COLS + 1, dtype=torch.int64))
    with pytest.raises(TypeError, match="carries"):
        call(carries=torch.zeros(3, dtype=torch.int32))
    flags = int(PlanFlag.SEED_IS_HEAD)
    assert flags  # the plan flags are schema values, never literals


def test_carries_are_checked_and_change_no_result_on_cpu() -> None:
    """The CPU and torch backends check the carries and scan: the same outputs with the carry bits (record, then
    reuse over an armed header of garbage rows), and nothing armed or written in the carries."""
    assert write_carries(7, "cpu").shape == (8, NUM_CARRY_COLS) and not write_carries(7, "cpu").any()
    for bad in (-1, 2.5, True):
        with pytest.raises(CanaryInputError, match="max_tokens"):
            write_carries(bad, "cpu")  # type: ignore[arg-type]
    case = make_case(3, checks=ALL_CHECKS, fp=True)
    garbage = torch.randint(-9, 99, (64, NUM_CARRY_COLS), dtype=torch.int64)
    garbage[0, int(CarryHeaderCol.ARMED)], garbage[0, int(CarryHeaderCol.STEP)] = 1, 17  # run_case's step
    for backend in ("torch", "cpu"):
        want_rec, want_sink = run_case(case, backend)
        for bit in (WriteCheck.RECORD_CARRIES, WriteCheck.REUSE_CARRIES):
            carries = garbage.clone()
            got_rec, got_sink = run_case(case, backend, checks=case.checks | int(bit), carries=carries)
            assert torch.equal(got_rec, want_rec) and ring_rows(got_sink) == ring_rows(want_sink)
            assert torch.equal(got_sink.counters, want_sink.counters) and torch.equal(carries, garbage)


def test_the_tail_write_takes_carries_only_without_a_seal_or_all_fingerprints() -> None:
    src = FingerprintSources([[SourceSpec(torch.zeros(8, 32, dtype=torch.uint8))]], num_slots=8)
    partial, every = Fingerprint(src, FingerprintMode.PARTIAL), Fingerprint(src, FingerprintMode.ALL)
    assert takes_carries(None, None) and takes_carries(None, partial)
    assert not takes_carries(every, partial) and not takes_carries(every, None) and not takes_carries(None, every)


def test_write_workspace_is_empty_on_cpu_and_changes_no_result() -> None:
    assert write_workspace(10_000, "cpu").numel() == 0
    for bad in (-1, 2.5, True):
        with pytest.raises(CanaryInputError, match="max_tokens"):
            write_workspace(bad, "cpu")  # type: ignore[arg-type]
    case = make_case(3, checks=ALL_CHECKS, fp=True)
    for backend in ("torch", "cpu"):
        want_rec, want_sink = run_case(case, backend)
        got_rec, got_sink = run_case(case, backend, workspace=torch.zeros(64, dtype=torch.int64))
        assert torch.equal(got_rec, want_rec) and ring_rows(got_sink) == ring_rows(want_sink)
        assert torch.equal(got_sink.counters, want_sink.counters)
