"""verify: a per-entry Python-int oracle of the contract against the torch reference and the CPU backend."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcanary import _native
from kvcanary.errors import CanaryInputError
from kvcanary.ops import hashes as H
from kvcanary.ops.plan import plan_forward, plan_sweep
from kvcanary.ops.types import Fingerprint, FingerprintSources, GroupView, Sink, SourceSpec, TokenPool
from kvcanary.ops.verify import verify
from kvcanary_schema import (
    FP_GAMMA,
    FP_POS_SEED,
    FP_SEED,
    NO_SLOT,
    NUM_COUNTER_COLS,
    NUM_LAUNCH_TAGS,
    NUM_PLAN_COLS,
    NUM_PLAN_STATUS_COLS,
    NUM_VIOLATION_COLS,
    PARTIAL_READ_BYTES,
    SKIP_TOKEN,
    TOKEN_LIMIT,
    CounterCol,
    FailReason,
    FingerprintMode,
    FpSourceCol,
    Group,
    LaunchTag,
    PlanCol,
    PlanFlag,
    PlanStatusCol,
    Stage,
    ViolationCol,
)

BACKENDS = ("torch", "cpu")
U64 = H.U64
VC = ViolationCol


# ---- Python-int oracle (docs/ops-contract.md 1, 4, 6) ----------------------------------------------------------

def fp_int(sources: FingerprintSources, half: int, slot: int, position: int, mode: FingerprintMode,
           stride: int) -> int:
    """Fingerprint from the source bytes, word by word (0 outside [0, TOKEN_LIMIT) like the fingerprint op)."""
    if not 0 <= position < TOKEN_LIMIT:
        return 0
    acc = 0
    meta = sources.table[half].tolist()
    for j, rows in enumerate(sources.rows[half]):
        if (j + position) % stride:
            continue
        page, bpt = meta[j][FpSourceCol.PAGE_SIZE], meta[j][FpSourceCol.BYTES_PER_TOKEN]
        rb = meta[j][FpSourceCol.READ_BYTES]
        if mode == FingerprintMode.PARTIAL:
            rb = min(rb, PARTIAL_READ_BYTES)
        off = (slot % page) * bpt
        raw = bytes(rows[slot // page, off:off + rb].tolist())
        for i in range(rb // 8):
            word = int.from_bytes(raw[8 * i:8 * i + 8], "little")
            acc += H.splitmix64_int(word ^ ((FP_SEED + ((j << 32) + i) * FP_GAMMA) & U64))
    return H.to_i64(H.splitmix64_int((acc & U64) ^ H.splitmix64_int((position & U64) ^ FP_POS_SEED)))


def link_int(rec: list[int]) -> int | None:
    tok, pos, prev = rec[0], rec[1], rec[2]
    if not (0 <= tok < TOKEN_LIMIT and 0 <= pos < TOKEN_LIMIT):
        return None
    return H.chain_step_int(H.to_u64(prev), tok, pos)


@dataclass
class Oracle:
    """What one verify call must produce: rows (as a multiset) and counter deltas."""

    rows: list[tuple[int, ...]] = field(default_factory=list)
    counters: dict[tuple[int, int], int] = field(default_factory=dict)

    def add(self, tag: int, c: CounterCol, v: int = 1) -> None:
        self.counters[(tag, int(c))] = self.counters.get((tag, int(c)), 0) + v

    def row(self, step: int, **cols: int) -> None:
        r = [0] * NUM_VIOLATION_COLS
        r[VC.EXPECTED_TOKEN], r[VC.EXPECTED_SLOT] = SKIP_TOKEN, NO_SLOT
        for k, v in cols.items():
            r[getattr(VC, k)] = v
        r[VC.STEP] = step
        self.rows.append(tuple(r))
        self.add(cols["TAG"], CounterCol.VIOLATIONS)


def oracle_verify(group: GroupView, stage: Stage, plan: torch.Tensor, status: torch.Tensor, table: torch.Tensor,
                  step: int, pool: TokenPool | None, fp: Fingerprint | None) -> Oracle:
    recs: list[list[list[int]]] = group.records.tolist()
    S, reserved = group.num_slots, group.reserved_slots
    smap = None if group.swa_map is None else group.swa_map.tolist()
    tbl: list[list[int]] = table.tolist()
    R, L = table.shape
    tags = group.tags(stage)
    o = Oracle()
    for tag in tags:
        o.add(tag, CounterCol.VERIFY_RUNS)

    def resolve(t: int) -> tuple[str, int]:
        if smap is None:
            if t < 0 or t >= S:
                return "err", t
            g = t
        else:
            if t < 0 or t >= len(smap):
                return "err", t
            g = smap[t]
            if g < 0:
                return "evicted", g
            if g >= S:
                return "err", g
        return ("reserved", g) if g < reserved else ("ok", g)

    nseg = min(max(int(status[PlanStatusCol.NUM_SEGMENTS]), 0), plan.shape[0])
    ptoks = pool.tokens.tolist() if pool else []
    plens = pool.lens.tolist() if pool else []
    for seg in plan[:nseg].tolist():
        row, b, e = seg[PlanCol.ROW], seg[PlanCol.IDX_BEGIN], seg[PlanCol.IDX_END]
        bi, flags = seg[PlanCol.BATCH_INDEX], seg[PlanCol.FLAGS]
        if not (0 <= row < R and 0 <= b <= e <= L):
            for tag in tags:
                o.row(step, TAG=tag, REASONS=FailReason.INPUT_ERROR, SLOT=NO_SLOT, BATCH_INDEX=bi, REQ_ROW=row)
                o.add(tag, CounterCol.INPUT_ERRORS)
            continue
        for idx in range(b, e):
            p = H.to_i64(idx + seg[PlanCol.POS_SHIFT])
            kind, s = resolve(tbl[row][idx])
            if kind == "err":
                for tag in tags:
                    o.row(step, TAG=tag, REASONS=FailReason.INPUT_ERROR, SLOT=s, POSITION=p, BATCH_INDEX=bi,
                          REQ_ROW=row)
                    o.add(tag, CounterCol.INPUT_ERRORS)
                continue
            if kind != "ok":
                for tag in tags:
                    o.add(tag, CounterCol.SKIPPED)
                continue
            anchor = idx == b and bool(flags & PlanFlag.FIRST_IS_HEAD)
            pred: int | None = None
            if not anchor:
                pk, ps = resolve(tbl[row][idx - 1] if idx > b else seg[PlanCol.FIRST_PREV_SLOT])
                pred = ps if pk == "ok" else None
            for h, tag in enumerate(tags):
                o.add(tag, CounterCol.ENTRIES_CHECKED)
                rec = recs[s][h]
                reasons = 0
                if rec[1] != p:
                    reasons |= FailReason.VERIFY_POSITION
                chain_bad, expected = False, 0
                if anchor:
                    expected = H.CHAIN_H0
                    chain_bad = H.to_u64(rec[2]) != expected
                elif pred is not None:
                    lk = link_int(recs[pred][h])
                    chain_bad = lk is None or H.to_u64(rec[2]) != lk
                    expected = 0 if lk is None else lk
                if chain_bad:
                    reasons |= FailReason.VERIFY_CHAIN
                own, bnd_mismatch = None, False
                if flags & PlanFlag.EXPECT_PREFIX and idx == e - 1:
                    own = link_int(rec)
                    if own is None:
                        reasons |= FailReason.VERIFY_CHAIN
                    elif own != H.to_u64(seg[PlanCol.EXPECT_PREFIX]):
                        reasons |= FailReason.VERIFY_TOKEN
                        bnd_mismatch = True
                exp_tok = SKIP_TOKEN
                if pool is not None and row < len(ptoks):
                    q = p + pool.offset
                    if 0 <= q < plens[row] and q < len(ptoks[row]):
                        exp_tok = ptoks[row][q]
                        if rec[0] != exp_tok:
                            reasons |= FailReason.VERIFY_TOKEN
                efp = 0
                share = fp.share if fp is not None and stage == Stage.TAIL else 1  # sweeps check every entry
                if fp is not None and (p + seg[PlanCol.PREFIX_LEN]) % share == 0:
                    efp = fp_int(fp.sources, h, s, p, fp.mode, fp.layer_stride)
                    if rec[3] != efp:
                        reasons |= FailReason.VERIFY_FINGERPRINT
                if reasons:
                    stored_hash = H.to_i64(own) if bnd_mismatch and not chain_bad and own is not None else rec[2]
                    exp_hash = H.to_i64(expected) if chain_bad else (seg[PlanCol.EXPECT_PREFIX] if bnd_mismatch else 0)
                    o.row(step, TAG=tag, REASONS=reasons, SLOT=s, POSITION=p, STORED_POSITION=rec[1],
                          BATCH_INDEX=bi, REQ_ROW=row, STORED_TOKEN=rec[0], EXPECTED_TOKEN=exp_tok,
                          STORED_HASH=stored_hash, EXPECTED_HASH=exp_hash, STORED_FP=rec[3], EXPECTED_FP=efp)
    return o


# ---- scenarios -------------------------------------------------------------------------------------------------

@dataclass
class Scenario:
    """One verify call's inputs (records written as a correct engine would, then corrupted)."""

    group: GroupView
    stage: Stage
    plan: torch.Tensor
    status: torch.Tensor
    table: torch.Tensor
    pool: TokenPool | None = None
    fp: Fingerprint | None = None
    truth: list[list[int]] = field(default_factory=list)  # true tokens per table row


def make_sources(rng: random.Random, halves: int, num_slots: int) -> FingerprintSources:
    n = rng.randint(1, 3)
    specs = []
    for _ in range(halves):
        hs = []
        for _ in range(n):
            page = rng.choice([1, 2, 3])
            bpt = rng.choice([16, 32, 48])
            rows = -(-num_slots // page) + rng.randint(0, 1)
            read = rng.choice([None, 0, 16, bpt])  # 0: a source that hashes nothing
            if rng.random() < 0.5:
                t = torch.randint(0, 256, (rows, page * bpt), dtype=torch.uint8)
            else:
                t = torch.randn(rows, page * bpt // 2).to(torch.bfloat16)
            hs.append(SourceSpec(t, page_size=page, read_bytes=read))
        specs.append(hs)
    return FingerprintSources(specs, num_slots)


def make_scenario(rng: random.Random, *, sweep: bool | None = None) -> Scenario:
    halves = rng.choice([1, 2])
    S = rng.randint(4, 40)
    reserved = rng.choice([0, 0, 1, 2])
    swa = rng.random() < 0.35
    space = rng.randint(4, 50) if swa else S
    smap = None
    if swa:
        smap = [NO_SLOT if rng.random() < 0.2 else rng.randrange(S) for _ in range(space)]
        if rng.random() < 0.2:
            smap[rng.randrange(space)] = S + rng.randint(0, 3)  # bad map value
    R, L = rng.randint(1, 5), rng.randint(0, 12)
    perm = list(range(space))
    rng.shuffle(perm)
    cells = [perm[k % space] for k in range(R * L)]
    for _ in range(rng.choice([0, 0, 1, 2])):
        if cells:
            cells[rng.randrange(len(cells))] = rng.choice([-3, -1, space, space + 7])  # bad table values
    dtype = rng.choice([torch.int32, torch.int64])
    table = torch.tensor(cells, dtype=dtype).view(R, L)
    stage = rng.choice([Stage.HEAD, Stage.TAIL, Stage.SWEEP])
    records = torch.zeros(S, halves, 4, dtype=torch.int64)
    group = GroupView(records, Group.SWA if swa else Group.FULL, reserved,
                      None if smap is None else torch.tensor(smap, dtype=torch.int64))
    fp = None
    if stage != Stage.HEAD and rng.random() < 0.6:
        fp = Fingerprint(make_sources(rng, halves, S), rng.choice([FingerprintMode.PARTIAL, FingerprintMode.ALL]),
                         rng.choice([1, 1, 2, 3]), rng.choice([1, 1, 2, 4]))

    def resolve(t: int) -> int | None:
        if not 0 <= t < space:
            return None
        g = t if smap is None else smap[t]
        return g if 0 <= g < S else None

    truth = [[rng.randrange(50) for _ in range(L)] for _ in range(R)]
    lengths = [rng.randint(0, L) for _ in range(R)]
    tl = table.tolist()
    for r in range(R):  # write each row's chain, as the write op would
        hv = H.CHAIN_H0
        for k in range(lengths[r]):
            tok = truth[r][k]
            g = resolve(tl[r][k])
            if g is not None:
                for h in range(halves):
                    f = fp_int(fp.sources, h, g, k, fp.mode, fp.layer_stride) if fp else 0
                    records[g, h] = torch.tensor([tok, k, H.to_i64(hv), f])
            hv = H.chain_step_int(hv, tok, k)
    for _ in range(rng.choice([0, 0, 1, 3])):  # corrupt record fields
        records[rng.randrange(S), rng.randrange(halves), rng.randrange(4)] += rng.choice([1, -1, 1 << 40])
    if fp is not None and rng.random() < 0.3:
        src = fp.sources.rows[rng.randrange(halves)][0]
        src[rng.randrange(src.shape[0]), rng.randrange(src.shape[1])] ^= 1 << rng.randrange(8)

    pool = None
    if rng.random() < 0.5:
        off = rng.choice([0, 1])
        ptoks = torch.tensor([[0] * off + row for row in truth], dtype=torch.int64).view(R, L + off)
        if ptoks.numel() and rng.random() < 0.3:
            ptoks.view(-1)[rng.randrange(ptoks.numel())] += 1
        plens = torch.tensor([min(L + off, lengths[r] + off + rng.randint(-1, 2)) for r in range(R)])
        pool = TokenPool(ptoks, plens, off)

    plan = torch.zeros(R + 20, NUM_PLAN_COLS, dtype=torch.int64)
    status = torch.zeros(NUM_PLAN_STATUS_COLS, dtype=torch.int64)
    if sweep if sweep is not None else rng.random() < 0.3:
        flat: list[int] = []
        starts, lens, firsts, prevs, ends = [], [], [], [], []
        for _ in range(rng.randint(0, 5)):
            r = rng.randrange(R)
            a = rng.randint(0, lengths[r])
            bb = rng.randint(a, lengths[r])
            starts.append(len(flat))
            flat += tl[r][a:bb]
            lens.append(bb - a)
            firsts.append(a)
            prevs.append(tl[r][a - 1] if a > 0 else NO_SLOT)
            hv = H.CHAIN_H0
            for k in range(bb):
                hv = H.chain_step_int(hv, truth[r][k], k)
            ends.append(H.to_i64(hv if rng.random() < 0.8 else hv + 1))
        slots = torch.tensor(flat, dtype=torch.int64)
        i64 = torch.tensor
        plan_sweep(plan, status, slots, i64(starts, dtype=torch.int64), i64(lens, dtype=torch.int64),
                   i64(firsts, dtype=torch.int64), i64(prevs, dtype=torch.int64),
                   expect_end=i64(ends, dtype=torch.int64) if rng.random() < 0.5 else None)
        table = slots.view(1, -1)
        pool = None if pool is None or R < 1 else TokenPool(pool.tokens[:1].contiguous(), pool.lens[:1].contiguous(),
                                                            pool.offset)
    else:
        bs = rng.randint(0, R + 2)
        rows = [rng.randrange(R) for _ in range(bs)]
        pre = [rng.randint(0, lengths[r]) for r in rows]
        ext = [rng.randint(0, L - p) for p in pre]
        ep = []
        for r, p in zip(rows, pre, strict=True):
            hv = H.CHAIN_H0
            for k in range(p):
                hv = H.chain_step_int(hv, truth[r][k], k)
            ep.append(H.to_i64(hv if rng.random() < 0.8 else hv ^ 4))
        t64 = torch.tensor
        plan_forward(plan, status, t64(rows, dtype=torch.int64), t64(pre, dtype=torch.int64),
                     t64(ext, dtype=torch.int64), table, sum(ext), window=rng.choice([0, 0, 2, 5]),
                     expect_prefix=t64(ep, dtype=torch.int64) if rng.random() < 0.5 else None)
    return Scenario(group, stage, plan, status, table, pool, fp, truth)


def random_plan(rng: random.Random, sc: Scenario) -> None:
    """Overwrite the scenario's plan with arbitrary rows (bad segments, odd shifts, flags) and NUM_SEGMENTS."""
    R, L = sc.table.shape
    for k in range(sc.plan.shape[0]):
        b = rng.randint(-1, L)
        e = rng.randint(b - 1, L + 1)
        sc.plan[k] = torch.tensor([k, rng.randint(-1, R), b, e, rng.choice([0, 0, 3, -2, TOKEN_LIMIT]), 0,
                                   rng.choice([NO_SLOT, -4, rng.randint(0, 60)]), 0, 0, NO_SLOT, 0,
                                   rng.getrandbits(63), 0, rng.randrange(16)])
    sc.status[PlanStatusCol.NUM_SEGMENTS] = rng.choice([-1, 0, 1, 3, sc.plan.shape[0], sc.plan.shape[0] + 5])


# ---- running and comparing -------------------------------------------------------------------------------------

def run(sc: Scenario, backend: str, cap: int = 4096, step: int = 7) -> tuple[list[tuple[int, ...]], int, torch.Tensor]:
    sink = Sink.allocate(cap)
    sink.step.fill_(step)
    records = sc.group.records.clone()
    verify(sc.group, sc.stage, sc.plan, sc.status, sc.table, sink, token_pool=sc.pool, fingerprint=sc.fp,
           backend=backend)
    assert torch.equal(records, sc.group.records), "verify mutated the records"
    n = int(sink.count)
    return [tuple(r) for r in sink.rows[:min(n, cap)].tolist()], n, sink.counters


def counters_of(o: Oracle) -> torch.Tensor:
    c = torch.zeros(NUM_LAUNCH_TAGS, NUM_COUNTER_COLS, dtype=torch.int64)
    for (tag, col), v in o.counters.items():
        c[tag, col] = v
    return c


def check_scenario(sc: Scenario) -> Oracle:
    want = oracle_verify(sc.group, sc.stage, sc.plan, sc.status, sc.table, 7, sc.pool, sc.fp)
    for backend in BACKENDS:
        rows, n, counters = run(sc, backend)
        assert n == len(want.rows), backend
        assert Counter(rows) == Counter(want.rows), backend
        assert torch.equal(counters, counters_of(want)), backend
    return want


def test_fuzz_seeded_plans_from_plan_ops() -> None:
    rng = random.Random(2024)
    reasons: Counter[int] = Counter()
    for _ in range(150):
        want = check_scenario(make_scenario(rng))
        for r in want.rows:
            for bit in FailReason:
                reasons[int(bit)] += bool(r[VC.REASONS] & bit)
    # The fuzz must reach every verify reason and input errors (else it proves little).
    for bit in (FailReason.VERIFY_CHAIN, FailReason.VERIFY_POSITION, FailReason.VERIFY_TOKEN,
                FailReason.VERIFY_FINGERPRINT, FailReason.INPUT_ERROR):
        assert reasons[int(bit)] > 0, bit


def test_fuzz_seeded_arbitrary_plans() -> None:
    rng = random.Random(77)
    for _ in range(80):
        sc = make_scenario(rng)
        random_plan(rng, sc)
        check_scenario(sc)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32), st.booleans())
def test_property(seed: int, sweep: bool) -> None:
    check_scenario(make_scenario(random.Random(seed), sweep=sweep))


def test_counts_add_up_and_runs_counted() -> None:
    rng = random.Random(3)
    for _ in range(60):
        sc = make_scenario(rng)
        total = int(sc.status[PlanStatusCol.VERIFY_ENTRIES])
        tags = sc.group.tags(sc.stage)
        for backend in BACKENDS:
            rows, n, c = run(sc, backend)
            for tag in tags:
                assert int(c[tag, CounterCol.VERIFY_RUNS]) == 1
                got = sum(int(c[tag, k]) for k in (CounterCol.ENTRIES_CHECKED, CounterCol.SKIPPED,
                                                   CounterCol.INPUT_ERRORS))
                assert got == total
                assert int(c[tag, CounterCol.VIOLATIONS]) == sum(1 for r in rows if r[VC.TAG] == tag)
            assert sum(int(c[t, CounterCol.VIOLATIONS]) for t in range(NUM_LAUNCH_TAGS)) == n


def test_ring_overflow_exact_counts_and_kept_rows_subset() -> None:
    rng = random.Random(11)
    seen = 0
    for _ in range(80):
        sc = make_scenario(rng)
        want = oracle_verify(sc.group, sc.stage, sc.plan, sc.status, sc.table, 7, sc.pool, sc.fp)
        if len(want.rows) < 2:
            continue
        seen += 1
        cap = rng.randint(1, len(want.rows) - 1)
        for backend in BACKENDS:
            rows, n, counters = run(sc, backend, cap=cap)
            assert n == len(want.rows) and len(rows) == cap
            assert not Counter(rows) - Counter(want.rows)
            assert torch.equal(counters, counters_of(want))
    assert seen >= 10


def test_ring_appends_after_existing_rows() -> None:
    sc = make_scenario(random.Random(5))
    random_plan(random.Random(6), sc)
    for backend in BACKENDS:
        sink = Sink.allocate(64)
        sink.count.fill_(60)
        sink.rows.fill_(-9)
        verify(sc.group, sc.stage, sc.plan, sc.status, sc.table, sink, token_pool=sc.pool, fingerprint=sc.fp,
               backend=backend)
        want = oracle_verify(sc.group, sc.stage, sc.plan, sc.status, sc.table, 0, sc.pool, sc.fp)
        assert int(sink.count) == 60 + len(want.rows)
        assert (sink.rows[:60] == -9).all()
        assert not Counter(tuple(r) for r in sink.rows[60:60 + len(want.rows)].tolist()) - Counter(want.rows)


# ---- hand-computed ---------------------------------------------------------------------------------------------

def _chain_case(backend: str, *, pool: bool = False, expect: int | None = None,
                corrupt: tuple[int, int, int, int] | None = None, table_edit: tuple[int, int] | None = None,
                reserved: int = 0) -> tuple[list[list[int]], Sink, list[int], list[int]]:
    """Request row 1 holds tokens [5, 7, 9, 11] at slots [3, 8, 2, 10] (both halves); HEAD verifies the prefix 4."""
    toks, slots = [5, 7, 9, 11], [3, 8, 2, 10]
    rec = torch.zeros(12, 2, 4, dtype=torch.int64)
    hv, hs = H.CHAIN_H0, []
    for p, (t, s) in enumerate(zip(toks, slots, strict=True)):
        hs.append(hv)
        rec[s, :] = torch.tensor([t, p, H.to_i64(hv), 0])
        hv = H.chain_step_int(hv, t, p)
    if corrupt:
        s, h, f, v = corrupt
        rec[s, h, f] = v
    table = torch.full((2, 6), -1, dtype=torch.int32)
    table[1, :4] = torch.tensor(slots)
    if table_edit:
        table[1, table_edit[0]] = table_edit[1]
    plan = torch.zeros(2, NUM_PLAN_COLS, dtype=torch.int64)
    status = torch.zeros(NUM_PLAN_STATUS_COLS, dtype=torch.int64)
    plan_forward(plan, status, torch.tensor([1]), torch.tensor([4]), torch.tensor([1]), table, 1,
                 expect_prefix=None if expect is None else torch.tensor([H.to_i64(expect)]))
    tp = TokenPool(torch.tensor([[0] * 6, toks + [0, 0]]), torch.tensor([0, 4])) if pool else None
    sink = Sink.allocate(16)
    sink.step.fill_(3)
    verify(GroupView(rec, reserved_slots=reserved), Stage.HEAD, plan, status, table, sink, token_pool=tp,
           backend=backend)
    n = int(sink.count)
    return sink.rows[:n].tolist(), sink, hs, [int(x) for x in rec.view(-1).tolist()]


def _row(**cols: int) -> list[int]:
    r = [0] * NUM_VIOLATION_COLS
    r[VC.EXPECTED_TOKEN], r[VC.STEP], r[VC.BATCH_INDEX], r[VC.REQ_ROW] = SKIP_TOKEN, 3, 0, 1
    r[VC.EXPECTED_SLOT] = NO_SLOT
    for k, v in cols.items():
        r[getattr(VC, k)] = v
    return r


HK, HV = int(LaunchTag.HEAD_K_FULL), int(LaunchTag.HEAD_V_FULL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_clean_chain_finds_nothing(backend: str) -> None:
    hv = H.CHAIN_H0
    for p, t in enumerate([5, 7, 9, 11]):
        hv = H.chain_step_int(hv, t, p)
    rows, sink, _, _ = _chain_case(backend, pool=True, expect=hv)
    assert rows == []
    for tag in (HK, HV):
        assert sink.counters[tag].tolist() == [1, 0, 4, 0, 0, 0, 0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_flip_breaks_the_next_link(backend: str) -> None:
    rows, _, hs, _ = _chain_case(backend, corrupt=(8, 1, 0, 70))  # slot 8 (position 1), V half: token 7 -> 70
    bad_link = H.to_i64(H.chain_step_int(hs[1], 70, 1))
    assert rows == [_row(TAG=HV, REASONS=FailReason.VERIFY_CHAIN, SLOT=2, POSITION=2, STORED_POSITION=2,
                         STORED_TOKEN=9, STORED_HASH=H.to_i64(hs[2]), EXPECTED_HASH=bad_link)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_flip_with_pool_names_the_token(backend: str) -> None:
    rows, _, hs, _ = _chain_case(backend, pool=True, corrupt=(8, 0, 0, 70))
    bad_link = H.to_i64(H.chain_step_int(hs[1], 70, 1))
    assert sorted(rows) == sorted([
        _row(TAG=HK, REASONS=FailReason.VERIFY_TOKEN, SLOT=8, POSITION=1, STORED_POSITION=1, STORED_TOKEN=70,
             EXPECTED_TOKEN=7, STORED_HASH=H.to_i64(hs[1])),
        _row(TAG=HK, REASONS=FailReason.VERIFY_CHAIN, SLOT=2, POSITION=2, STORED_POSITION=2, STORED_TOKEN=9,
             EXPECTED_TOKEN=9, STORED_HASH=H.to_i64(hs[2]), EXPECTED_HASH=bad_link)])


@pytest.mark.parametrize("backend", BACKENDS)
def test_position_and_prev_hash_flips(backend: str) -> None:
    rows, _, hs, _ = _chain_case(backend, corrupt=(3, 0, 1, 9))  # head record's position 0 -> 9
    link9 = H.to_i64(H.chain_step_int(hs[0], 5, 9))
    assert sorted(rows) == sorted([
        _row(TAG=HK, REASONS=FailReason.VERIFY_POSITION, SLOT=3, POSITION=0, STORED_POSITION=9, STORED_TOKEN=5,
             STORED_HASH=H.to_i64(hs[0])),
        _row(TAG=HK, REASONS=FailReason.VERIFY_CHAIN, SLOT=8, POSITION=1, STORED_POSITION=1, STORED_TOKEN=7,
             STORED_HASH=H.to_i64(hs[1]), EXPECTED_HASH=link9)])
    rows, _, hs, _ = _chain_case(backend, corrupt=(3, 1, 2, 12345))  # head record's prev_hash
    assert sorted(rows) == sorted([
        _row(TAG=HV, REASONS=FailReason.VERIFY_CHAIN, SLOT=3, POSITION=0, STORED_TOKEN=5, STORED_HASH=12345,
             EXPECTED_HASH=H.to_i64(H.CHAIN_H0)),
        _row(TAG=HV, REASONS=FailReason.VERIFY_CHAIN, SLOT=8, POSITION=1, STORED_POSITION=1, STORED_TOKEN=7,
             STORED_HASH=H.to_i64(hs[1]), EXPECTED_HASH=H.to_i64(H.chain_step_int(12345, 5, 0)))])


@pytest.mark.parametrize("backend", BACKENDS)
def test_boundary_check(backend: str) -> None:
    hv = H.CHAIN_H0
    for p, t in enumerate([5, 7, 9, 12]):  # the request's true last token is 12, the KV holds 11
        hv = H.chain_step_int(hv, t, p)
    rows, _, hs, _ = _chain_case(backend, expect=hv)
    stored = H.to_i64(H.chain_step_int(hs[3], 11, 3))
    want = [_row(TAG=tag, REASONS=FailReason.VERIFY_TOKEN, SLOT=10, POSITION=3, STORED_POSITION=3, STORED_TOKEN=11,
                 STORED_HASH=stored, EXPECTED_HASH=H.to_i64(hv)) for tag in (HK, HV)]
    assert sorted(rows) == sorted(want)
    rows, _, hs, _ = _chain_case(backend, expect=hv, corrupt=(10, 0, 0, -1))  # no link at the boundary
    assert sorted(rows) == sorted([
        _row(TAG=HK, REASONS=FailReason.VERIFY_CHAIN, SLOT=10, POSITION=3, STORED_POSITION=3, STORED_TOKEN=-1,
             STORED_HASH=H.to_i64(hs[3])),
        _row(TAG=HV, REASONS=FailReason.VERIFY_TOKEN, SLOT=10, POSITION=3, STORED_POSITION=3, STORED_TOKEN=11,
             STORED_HASH=stored, EXPECTED_HASH=H.to_i64(hv))])


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_slot_is_an_input_error_and_reserved_is_skipped(backend: str) -> None:
    rows, sink, _, _ = _chain_case(backend, table_edit=(1, 99))
    assert sorted(rows) == sorted([_row(TAG=tag, REASONS=FailReason.INPUT_ERROR, SLOT=99, POSITION=1)
                                   for tag in (HK, HV)])  # the next entry's link check is skipped, silently
    for tag in (HK, HV):
        assert sink.counters[tag].tolist() == [1, 0, 3, 0, 1, 1, 0]
    rows, sink, _, _ = _chain_case(backend, reserved=3)  # slot 2 (position 2) is reserved: skipped
    assert rows == []
    for tag in (HK, HV):
        assert sink.counters[tag].tolist() == [1, 0, 3, 0, 0, 0, 1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_swa_evicted_and_bad_map_value(backend: str) -> None:
    rec = torch.zeros(4, 1, 4, dtype=torch.int64)
    hv = H.CHAIN_H0
    smap = [NO_SLOT, 2, 9, 3, NO_SLOT]  # table slots 0..4 -> SWA slots
    for p, t in enumerate([4, 6]):  # positions 0, 1 at table slots 1, 3 -> SWA 2, 3
        rec[[2, 3][p], 0] = torch.tensor([t, p, H.to_i64(hv), 0])
        hv = H.chain_step_int(hv, t, p)
    table = torch.tensor([[1, 3, 4, 2]])
    plan = torch.zeros(1, NUM_PLAN_COLS, dtype=torch.int64)
    status = torch.zeros(NUM_PLAN_STATUS_COLS, dtype=torch.int64)
    plan_forward(plan, status, torch.tensor([0]), torch.tensor([4]), torch.tensor([0]), table, 0)
    sink = Sink.allocate(4)
    g = GroupView(rec, Group.SWA, 0, torch.tensor(smap))
    verify(g, Stage.TAIL, plan, status, table, sink, backend=backend)
    tag = int(LaunchTag.TAIL_K_SWA)
    assert sink.rows[:int(sink.count)].tolist() == [
        [tag, int(FailReason.INPUT_ERROR), 9, 3, 0, 0, 0, 0, SKIP_TOKEN, 0, 0, 0, 0, 0, NO_SLOT]]
    assert sink.counters[tag].tolist() == [1, 0, 2, 0, 1, 1, 1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_fingerprint_flip(backend: str) -> None:
    kv = torch.randint(0, 256, (6, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    src = FingerprintSources([[SourceSpec(kv)]], 6)
    rec = torch.zeros(6, 1, 4, dtype=torch.int64)
    hv = H.CHAIN_H0
    for p, (t, s) in enumerate(zip([1, 2, 3], [4, 1, 5], strict=True)):
        rec[s, 0] = torch.tensor([t, p, H.to_i64(hv), fp_int(src, 0, s, p, FingerprintMode.ALL, 1)])
        hv = H.chain_step_int(hv, t, p)
    old = int(rec[1, 0, 3])
    kv[1, 17] ^= 0x10
    table = torch.tensor([[4, 1, 5]])
    plan = torch.zeros(1, NUM_PLAN_COLS, dtype=torch.int64)
    status = torch.zeros(NUM_PLAN_STATUS_COLS, dtype=torch.int64)
    plan_forward(plan, status, torch.tensor([0]), torch.tensor([3]), torch.tensor([0]), table, 0)
    sink = Sink.allocate(4)
    verify(GroupView(rec), Stage.TAIL, plan, status, table, sink, fingerprint=Fingerprint(src), backend=backend)
    new = fp_int(src, 0, 1, 1, FingerprintMode.ALL, 1)
    assert new != old
    r = sink.rows[0].tolist()
    assert int(sink.count) == 1
    assert (r[VC.REASONS], r[VC.SLOT], r[VC.POSITION], r[VC.STORED_FP], r[VC.EXPECTED_FP]) == (
        FailReason.VERIFY_FINGERPRINT, 1, 1, old, new)
    # PARTIAL reads only the first 16 bytes: byte 17 is not seen.
    sink2 = Sink.allocate(4)
    rec[:, 0, 3] = torch.tensor([fp_int(src, 0, s, 0, FingerprintMode.PARTIAL, 1) for s in range(6)])
    rec[1, 0, 3] = fp_int(src, 0, 1, 1, FingerprintMode.PARTIAL, 1)
    rec[5, 0, 3] = fp_int(src, 0, 5, 2, FingerprintMode.PARTIAL, 1)
    kv[1, 17] ^= 0x10
    part = Fingerprint(src, FingerprintMode.PARTIAL)
    verify(GroupView(rec), Stage.TAIL, plan, status, table, sink2, fingerprint=part, backend=backend)
    assert int(sink2.count) == 0


# ---- bad arguments ---------------------------------------------------------------------------------------------

@pytest.fixture
def no_native(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(kind: str) -> None:
        raise AssertionError("native module reached despite a bad argument")
    monkeypatch.setattr(_native, "module", boom)


def _verify_args() -> dict[str, Any]:
    sc = make_scenario(random.Random(8), sweep=False)
    return {"group": sc.group, "stage": Stage.TAIL, "plan": sc.plan, "status": sc.status, "table": sc.table,
            "sink": Sink.allocate(8)}


def _variants(t: torch.Tensor) -> list[object]:
    out: list[object] = [t.to(torch.float32), t.tolist(), t.to("meta"), t.view(-1)[:-1] if t.numel() > 1 else t[:0]]
    if t.dim() == 2 and t.shape[0] > 1 and t.shape[1] > 1:
        out.append(t.t())
    return out


@pytest.mark.parametrize("name", ["plan", "status", "table"])
def test_bad_tensor_args(name: str, no_native: None) -> None:
    base = _verify_args()
    for bad in _variants(base[name]):
        if name == "table" and isinstance(bad, torch.Tensor) and bad.dim() == 1 and bad.numel() == 0:
            continue
        with pytest.raises(CanaryInputError, match=name):
            verify(**dict(base, **{name: bad}), backend="cpu")


@pytest.mark.parametrize("field_name", ["rows", "count", "counters", "step"])
def test_bad_sink(field_name: str, no_native: None) -> None:
    base = _verify_args()
    names = {"rows": "ring rows", "count": "ring count", "counters": "counters", "step": "step"}
    for bad in _variants(getattr(base["sink"], field_name)):
        sink = Sink.allocate(8)
        setattr(sink, field_name, bad)
        with pytest.raises(CanaryInputError, match=names[field_name]):
            verify(**dict(base, sink=sink), backend="cpu")


def test_validated_sink_is_checked_again_after_a_change() -> None:
    """Sink.validate remembers the last sink it passed: another device or a replaced tensor is checked again."""
    sink = Sink.allocate(8)
    sink.validate(torch.device("cpu"))
    with pytest.raises(CanaryInputError, match="must be on meta"):
        sink.validate(torch.device("meta"))
    sink.validate(torch.device("cpu"))
    sink.count = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(CanaryInputError, match="ring count"):
        sink.validate(torch.device("cpu"))


def test_bad_objects_and_options(no_native: None) -> None:
    base = _verify_args()
    src = make_sources(random.Random(1), base["group"].halves, base["group"].num_slots)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"group": base["group"].records}, "group"), ({"stage": 1}, "stage"), ({"sink": None}, "sink"),
        ({"token_pool": (1, 2)}, "token_pool"), ({"fingerprint": src}, "fingerprint"),
        ({"stage": Stage.HEAD, "fingerprint": Fingerprint(src)}, "HEAD"),
        ({"backend": "gpu"}, "backend"), ({"max_segment_entries": -1}, "max_segment_entries"),
        ({"max_segment_entries": True}, "max_segment_entries"),
        ({"token_pool": TokenPool(torch.zeros(2, 3, dtype=torch.int64, device="meta"),
                                  torch.zeros(2, dtype=torch.int64, device="meta"))}, "token pool"),
        ({"fingerprint": Fingerprint(FingerprintSources([[SourceSpec(torch.zeros(2, 16, dtype=torch.uint8))]] * 2,
                                                        2))}, "slots"),
    ]
    for kw, match in cases:
        with pytest.raises(CanaryInputError, match=match):
            verify(**dict(base, **kw))


def test_native_entry_validates_again() -> None:
    m = _native.module("cpu")
    sc = make_scenario(random.Random(8), sweep=False)
    sink = Sink.allocate(8)
    e = torch.empty(0, dtype=torch.int64)
    g = sc.group
    call: list[Any] = [g.records, e if g.swa_map is None else g.swa_map, int(g.swa_map is not None),
                       g.reserved_slots, 2, 3, sc.plan, sc.status, sc.table, sink.rows, sink.count, sink.counters,
                       sink.step, e, e, 0, 0, e, 0, 1, 1, 1, 0]
    m.verify(*call)
    bads: list[tuple[int, Any]] = [
        (0, g.records.view(g.num_slots, -1)), (0, torch.zeros(3, 3, 4, dtype=torch.int64)),
        (2, 1 - call[2]) if g.swa_map is None else (1, torch.zeros(2, 2, dtype=torch.int64)),
        (3, -1), (3, g.num_slots + 1), (4, NUM_LAUNCH_TAGS), (4, -1), (6, sc.plan[:, :3].contiguous()),
        (7, e), (8, sc.table.to(torch.float32)), (9, sink.rows[:, :4].contiguous()), (10, e),
        (11, sink.counters[:3].contiguous()), (12, e), (15, 1), (18, 7), (18, int(FingerprintMode.ALL)),
        (20, 0), (20, -2), (21, 0), (21, 3), (21, -4), (22, -1),
    ]
    if g.halves == 2:
        bads.append((5, 99))
    for k, bad in bads:
        bad_call = list(call)
        bad_call[k] = bad
        with pytest.raises((ValueError, TypeError)):
            m.verify(*bad_call)
    with_pool = list(call)
    with_pool[13:17] = [torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), 1, -1]
    with pytest.raises(ValueError):
        m.verify(*with_pool)
    with_fp = list(call)
    src = make_sources(random.Random(2), g.halves, g.num_slots)
    with_fp[17:20] = [src.table, int(FingerprintMode.ALL), 0]
    with pytest.raises(ValueError):
        m.verify(*with_fp)


def test_fingerprint_zero_past_token_limit() -> None:
    rng = random.Random(21)
    src = make_sources(rng, 2, 8)
    rec = torch.zeros(8, 2, 4, dtype=torch.int64)
    rec[:, :, 3] = 5
    slots = torch.tensor([3, 4, 6], dtype=torch.int64)
    plan = torch.zeros(1, NUM_PLAN_COLS, dtype=torch.int64)
    status = torch.zeros(NUM_PLAN_STATUS_COLS, dtype=torch.int64)
    one = torch.ones(1, dtype=torch.int64)
    plan_sweep(plan, status, slots, 0 * one, 3 * one, (TOKEN_LIMIT - 2) * one, NO_SLOT * one)
    sc = Scenario(GroupView(rec), Stage.SWEEP, plan, status, slots.view(1, -1), fp=Fingerprint(src))
    want = check_scenario(sc)
    past = [r for r in want.rows if r[VC.POSITION] >= TOKEN_LIMIT]
    assert len(past) == 2 and all(r[VC.EXPECTED_FP] == 0 and r[VC.REASONS] & FailReason.VERIFY_FINGERPRINT
                                  for r in past)
    assert all(r[VC.EXPECTED_FP] != 0 for r in want.rows if r[VC.POSITION] < TOKEN_LIMIT)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("share", [1, 2, 4])
def test_fingerprint_share_checks_each_read_slot_once_in_share_forwards(backend: str, share: int) -> None:
    """A decoding request (prefix + 1 per forward) whose every stored fingerprint is wrong: under share S each TAIL
    verify reports exactly the positions p with (p + prefix) % S == 0, so S consecutive forwards report every read
    slot once; a SWEEP verify ignores the share."""
    n = 11
    kv = torch.randint(0, 256, (n + 1, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    src = FingerprintSources([[SourceSpec(kv)]], n + 1)
    rec = torch.zeros(n + 1, 1, 4, dtype=torch.int64)
    hv = H.CHAIN_H0
    for p in range(n):
        rec[p + 1, 0] = torch.tensor([p + 7, p, H.to_i64(hv), fp_int(src, 0, p + 1, p, FingerprintMode.PARTIAL, 1) ^ 1])
        hv = H.chain_step_int(hv, p + 7, p)
    table = torch.arange(1, n + 1).view(1, n)
    fp = Fingerprint(src, FingerprintMode.PARTIAL, share=share)
    plan = torch.zeros(1, NUM_PLAN_COLS, dtype=torch.int64)
    status = torch.zeros(NUM_PLAN_STATUS_COLS, dtype=torch.int64)
    seen: Counter[int] = Counter()
    first = n - share
    for pre in range(first, n):
        plan_forward(plan, status, torch.tensor([0]), torch.tensor([pre]), torch.tensor([0]), table, 0)
        sink = Sink.allocate(64)
        verify(GroupView(rec), Stage.TAIL, plan, status, table, sink, fingerprint=fp, backend=backend)
        rows = sink.rows[:int(sink.count)].tolist()
        assert all(r[VC.REASONS] == FailReason.VERIFY_FINGERPRINT for r in rows)
        got = sorted(r[VC.POSITION] for r in rows)
        assert got == [p for p in range(pre) if (p + pre) % share == 0]
        seen.update(got)
    assert all(seen[p] == 1 for p in range(first)), seen
    sink = Sink.allocate(64)
    verify(GroupView(rec), Stage.SWEEP, plan, status, table, sink, fingerprint=fp, backend=backend)
    assert int(sink.count) == n - 1  # the last plan's whole prefix: the share does not apply to sweeps


def test_fingerprint_share_must_be_a_power_of_two() -> None:
    src = make_sources(random.Random(5), 1, 4)
    for bad in (0, 3, -2, True, 2.0):
        with pytest.raises(CanaryInputError, match="share"):
            Fingerprint(src, FingerprintMode.PARTIAL, share=bad)  # type: ignore[arg-type]
