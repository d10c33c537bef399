"""plan_roll (one rolling-sweep slice): a Python-int oracle of docs/ops-contract.md 3a vs torch and the CPU backend."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcanary.errors import CanaryInputError
from kvcanary.ops.plan import bind_plan_roll, derive_roll, plan_roll
from kvcanary_schema import NO_SLOT, NUM_PLAN_COLS, NUM_PLAN_STATUS_COLS, PlanCol, PlanStatusCol
from test_plan import BIG, i64, oracle_sweep

BACKENDS = ("torch", "cpu")


@dataclass
class Export:
    """A flat export plus what the sweeper derives from it (ends, inverse slot map)."""

    slots: list[int]
    starts: list[int]
    lens: list[int]
    firsts: list[int]
    prevs: list[int]
    unlocked: list[int] | None
    ends: list[int]
    inv: list[int]


def first_past(ends: list[int], k: int) -> int:
    """The contract's binary search: the first c with ends[c] > k when ends is non-decreasing (its definition)."""
    lo, hi = 0, len(ends)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ends[mid] > k else (mid + 1, hi)
    return lo


def oracle_roll(e: Export, m: int, cursor: int, width: int) -> tuple[list[list[int]], list[int], list[int]]:
    """docs/ops-contract.md 3a, literally: the W one-slot chains, then the plan_sweep oracle over them."""
    n, big = len(e.starts), len(e.slots)
    chains: list[tuple[int, int, int, int]] = []
    names: list[int] = []
    for i in range(width):
        sid = (cursor + i) % m
        k = e.inv[sid]
        c = first_past(e.ends, k) if 0 <= k < big and e.slots[k] == sid and n else n
        start = e.starts[c] if c < n else -1
        ok = c < n and 0 <= start == e.ends[c] - max(e.lens[c], 0) and start <= k
        ok = ok and (e.unlocked is None or e.unlocked[c] != 0)
        if ok:
            off = k - start
            chains.append((k, 1, e.firsts[c] + off, e.slots[k - 1] if off > 0 else e.prevs[c]))
            names.append(c)
        else:
            chains.append((0, 0, 0, NO_SLOT))
            names.append(-1)
    segs, status = oracle_sweep(big, *[list(x) for x in zip(*chains, strict=True)]) if chains else ([], [0] * 5)
    return segs, status, names


def run_roll(backend: str, e: Export, m: int, cursor: int, width: int, cap_extra: int = 0
             ) -> tuple[list[list[int]], list[int], list[int]]:
    plan = torch.full((width + cap_extra, NUM_PLAN_COLS), 777, dtype=torch.int64)
    status = torch.full((NUM_PLAN_STATUS_COLS,), 555, dtype=torch.int64)
    chain_out = torch.full((width,), 333, dtype=torch.int64)
    plan_roll(plan, status, chain_out, i64(e.slots), i64(e.starts), i64(e.lens), i64(e.ends), i64(e.firsts),
              i64(e.prevs), i64(e.inv), m, cursor, unlocked=None if e.unlocked is None else i64(e.unlocked),
              backend=backend)
    n = int(status[PlanStatusCol.NUM_SEGMENTS])
    return plan[:n].tolist(), status.tolist(), chain_out.tolist()


def export_of(chains: list[list[int]], m: int, firsts: list[int], prevs: list[int],
              unlocked: list[int] | None = None) -> Export:
    """A back-to-back export of the given chains of table slots, with its running ends and inverse map."""
    slots = [s for ch in chains for s in ch]
    lens = [len(ch) for ch in chains]
    ends = [sum(lens[:c + 1]) for c in range(len(lens))]
    inv = [-1] * m
    for k, s in enumerate(slots):
        if 0 <= s < m:
            inv[s] = k
    return Export(slots, [e - n for e, n in zip(ends, lens, strict=True)], lens, firsts, prevs, unlocked, ends, inv)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_case(backend: str) -> None:
    # chain 0 = slots 5, 2 at positions 0, 1; chain 1 = slots 7, 3 at positions 16, 17 after slot 9 (locked)
    e = export_of([[5, 2], [7, 3]], 10, [0, 16], [NO_SLOT, 9], unlocked=[1, 0])
    segs, status, names = run_roll(backend, e, 10, 1, 5)  # slot ids 1..5: 1 -, 2 = (chain 0, k 1), 3 locked, 4 -, 5
    assert names == [-1, 0, -1, -1, 0]
    assert status == [5, 2, 0, 0, 0]
    # entry 1: k = 1, position 1, previous slot 5; entry 4: k = 0, the chain head
    assert segs[1][PlanCol.IDX_BEGIN:PlanCol.IDX_END + 1] == [1, 2]
    assert segs[1][PlanCol.POS_SHIFT] == 0 and segs[1][PlanCol.FIRST_PREV_SLOT] == 5
    assert segs[4][PlanCol.IDX_BEGIN:PlanCol.IDX_END + 1] == [0, 1]
    assert segs[4][PlanCol.FIRST_PREV_SLOT] == NO_SLOT and segs[4][PlanCol.ENTRY_OFFSET] == 1
    assert [s[PlanCol.BATCH_INDEX] for s in segs] == [0, 1, 2, 3, 4]
    e.unlocked = None  # chain 1 counts now: slot 3 is its second slot, after slot 7
    segs, _, names = run_roll(backend, e, 10, 8, 6)  # ids 8, 9, 0, 1, 2, 3 (wraps)
    assert names == [-1, -1, -1, -1, 0, 1]
    assert segs[5][PlanCol.FIRST_PREV_SLOT] == 7 and segs[5][PlanCol.POS_SHIFT] == 17 - 3


def _random_export(rng: random.Random) -> tuple[Export, int, int, int]:
    m = rng.randint(1, 40)
    n = rng.randint(0, 6)
    free = rng.sample(range(m), k=rng.randint(0, m))
    chains: list[list[int]] = []
    for _ in range(n):
        take, free = free[:rng.randint(0, 4)], free[rng.randint(0, 4):]
        chains.append(take)
    e = export_of(chains, m, [rng.randint(0, 60) for _ in range(n)],
                  [rng.choice([NO_SLOT, rng.randint(0, m)]) for _ in range(n)],
                  [rng.randint(0, 1) for _ in range(n)] if rng.random() < 0.5 else None)

    def spoil(xs: list[int], values: list[int]) -> None:  # bad values the op must survive (never read out of bounds)
        if xs and rng.random() < 0.25:
            xs[rng.randrange(len(xs))] = rng.choice(values)
    spoil(e.inv, [-5, len(e.slots), len(e.slots) + 3, BIG, *range(len(e.slots))])  # an index holding another id
    spoil(e.starts, [-1, -BIG, BIG, 1])
    spoil(e.lens, [-2, BIG, 0])
    spoil(e.firsts, [-3, -BIG])
    spoil(e.ends, [-1, BIG, 0])  # non-monotone ends: an unspecified chain, the same in every backend
    if rng.random() < 0.2 and e.slots:
        e.slots[rng.randrange(len(e.slots))] = rng.choice([-4, m + 2])
    width = rng.randint(0, 2 * m)
    return e, m, rng.randrange(m), width


def test_fuzz_seeded() -> None:
    rng = random.Random(77)
    for _ in range(400):
        e, m, cursor, width = _random_export(rng)
        want = oracle_roll(e, m, cursor, width)
        for backend in BACKENDS:
            assert run_roll(backend, e, m, cursor, width, rng.randint(0, 2)) == want, backend


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32))
def test_property(seed: int) -> None:
    e, m, cursor, width = _random_export(random.Random(seed))
    want = oracle_roll(e, m, cursor, width)
    for backend in BACKENDS:
        assert run_roll(backend, e, m, cursor, width) == want, backend


def test_every_cached_slot_once_per_walk() -> None:
    """Walking the slot ids W at a time covers every cached slot within ceil(m / W) slices (the ids past m wrap)."""
    rng = random.Random(3)
    m, width = 37, 8
    slots = rng.sample(range(m), 30)
    e = export_of([slots[:10], slots[10:25], slots[25:]], m, [0, 0, 0], [NO_SLOT] * 3)
    seen: list[int] = []
    cursor = 0
    for _ in range(-(-m // width)):
        segs, _, _ = run_roll("cpu", e, m, cursor, width)
        seen += [e.slots[s[PlanCol.IDX_BEGIN]] for s in segs if s[PlanCol.IDX_END] > s[PlanCol.IDX_BEGIN]]
        cursor = (cursor + width) % m
    again = [s for s in range(-(-m // width) * width - m) if s in slots]  # ids visited a second time
    assert sorted(seen) == sorted(slots + again)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_arguments(backend: str) -> None:
    e = export_of([[1, 2]], 4, [0], [NO_SLOT])
    plan, status = torch.zeros(4, NUM_PLAN_COLS, dtype=torch.int64), torch.zeros(NUM_PLAN_STATUS_COLS,
                                                                                  dtype=torch.int64)
    base = dict(plan=plan, status=status, chain_out=torch.zeros(4, dtype=torch.int64), slots=i64(e.slots),
                starts=i64(e.starts), lens=i64(e.lens), ends=i64(e.ends), first_positions=i64(e.firsts),
                prev_slots=i64(e.prevs), inv=i64(e.inv), num_slot_ids=4, cursor=0)
    for over, msg in (({"cursor": 4}, "cursor"), ({"cursor": -1}, "cursor"), ({"num_slot_ids": 5}, "inv"),
                      ({"num_slot_ids": 0}, "num_slot_ids"), ({"ends": i64([1, 2])}, "ends"),
                      ({"chain_out": torch.zeros(5, dtype=torch.int64)}, "slice"),
                      ({"inv": torch.zeros(4, dtype=torch.int32)}, "inv"),
                      ({"unlocked": i64([1, 1])}, "unlocked")):
        with pytest.raises(CanaryInputError, match=msg):
            plan_roll(**{**base, **over}, backend=backend)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bound_planner_takes_each_cursor(backend: str) -> None:
    """bind_plan_roll checks the export once; each call plans the slice of its cursor, as plan_roll does."""
    rng = random.Random(11)
    e, m, _, width = _random_export(rng)
    width = max(width, 1)
    plan, status = torch.zeros(width, NUM_PLAN_COLS, dtype=torch.int64), torch.zeros(NUM_PLAN_STATUS_COLS,
                                                                                      dtype=torch.int64)
    chain_out = torch.zeros(width, dtype=torch.int64)
    run = bind_plan_roll(plan, status, chain_out, i64(e.slots), i64(e.starts), i64(e.lens), i64(e.ends),
                         i64(e.firsts), i64(e.prevs), i64(e.inv), m,
                         unlocked=None if e.unlocked is None else i64(e.unlocked), backend=backend)
    for cursor in (0, m - 1, m // 2):
        run(cursor)
        n = int(status[PlanStatusCol.NUM_SEGMENTS])
        assert (plan[:n].tolist(), status.tolist(), chain_out.tolist()) == oracle_roll(e, m, cursor, width)
    for bad in (m, -1, True, 1.0):
        with pytest.raises(CanaryInputError, match="cursor"):
            run(bad)  # type: ignore[arg-type]


# ---- derive_roll -------------------------------------------------------------------------------------------------

def run_derive(backend: str, slots: list[int], lens: list[int], inv: list[int], m: int) -> tuple[list[int], list[int]]:
    iv, ends = i64(inv), torch.full((len(lens),), 99, dtype=torch.int64)
    derive_roll(i64(slots), i64(lens), iv, ends, m, backend=backend)
    return iv.tolist(), ends.tolist()


def derive_ok(slots: list[int], lens: list[int], inv: list[int], m: int, got: tuple[list[int], list[int]]) -> None:
    """The contract: each id in [0, m) maps to one of its indices, every other entry is kept, ends wrap as int64."""
    got_inv, got_ends = got
    assert len(got_inv) == len(inv)
    for sid, k in enumerate(got_inv):
        held = [j for j, x in enumerate(slots) if x == sid] if sid < m else []
        assert (k in held) if held else k == inv[sid]
    run, want = 0, []
    for x in lens:
        run = (run + max(x, 0) + 2**63) % 2**64 - 2**63
        want.append(run)
    assert got_ends == want


@pytest.mark.parametrize("backend", BACKENDS)
def test_derive_hand_case(backend: str) -> None:
    # slot 3 at index 1 and 4 (either), 7 outside m = 6, -2 skipped; inv[5] stays 11 and inv[6] (past m) stays 4
    got = run_derive(backend, [0, 3, 7, -2, 3, 1], [2, -1, 3, 1], [-1, 9, 8, 8, 8, 11, 4], 6)
    assert got[0][0] == 0 and got[0][1] == 5 and got[0][2] == 8 and got[0][3] in (1, 4) and got[0][4:] == [8, 11, 4]
    assert got[1] == [2, 2, 5, 6]


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**32))
def test_derive_property(seed: int) -> None:
    rng = random.Random(seed)
    m = rng.randint(1, 30)
    slots = [rng.randint(-3, m + 3) for _ in range(rng.randint(0, 40))]
    lens = [rng.choice([rng.randint(-4, 9), BIG, 2**63 - 1]) for _ in range(rng.randint(0, 12))]
    inv = [rng.randint(-2, 50) for _ in range(m + rng.randint(0, 3))]
    for backend in BACKENDS:
        derive_ok(slots, lens, inv, m, run_derive(backend, slots, lens, inv, m))


def test_derive_over_an_earlier_export_plans_as_a_fresh_map() -> None:
    """The inverse map is never cleared: entries an earlier export left are ignored by plan_roll."""
    rng = random.Random(5)
    for _ in range(100):
        older, _, _, _ = _random_export(rng)
        e, m, cursor, width = _random_export(rng)
        for backend in BACKENDS:
            iv, ends = i64((older.inv + [-1] * m)[:m]), torch.zeros(len(e.lens), dtype=torch.int64)
            derive_roll(i64(e.slots), i64(e.lens), iv, ends, m, backend=backend)
            fresh = Export(e.slots, e.starts, e.lens, e.firsts, e.prevs, e.unlocked, ends.tolist(), iv.tolist())
            clean = export_of([], m, [], [])  # the oracle's map: only this export's ids
            for k, sid in enumerate(e.slots):
                if 0 <= sid < m:
                    clean.inv[sid] = k
            want = oracle_roll(Export(e.slots, e.starts, e.lens, e.firsts, e.prevs, e.unlocked, ends.tolist(),
                                      clean.inv), m, cursor, width)
            assert run_roll(backend, fresh, m, cursor, width) == want, backend


@pytest.mark.parametrize("backend", BACKENDS)
def test_derive_bad_arguments(backend: str) -> None:
    base = dict(slots=i64([1, 2]), lens=i64([2]), inv=i64([0] * 4), ends=i64([0]), num_slot_ids=4)
    for over, msg in (({"num_slot_ids": 5}, "inv"), ({"num_slot_ids": 0}, "num_slot_ids"),
                      ({"ends": i64([1, 2])}, "ends"), ({"inv": torch.zeros(4, dtype=torch.int32)}, "inv"),
                      ({"slots": i64([[1]])}, "slots"),
                      ({"lens": torch.zeros(1)}, "lens"), ({"num_slot_ids": True}, "num_slot_ids")):
        with pytest.raises(CanaryInputError, match=msg):
            derive_roll(**{**base, **over}, backend=backend)  # type: ignore[arg-type]
    assert base["inv"].tolist() == [0] * 4 and base["ends"].tolist() == [0]


def test_derive_native_entry_validates_again() -> None:
    from kvcanary import _native  # noqa: PLC0415

    fn = _native.module("cpu").derive_roll
    inv, ends = i64([0] * 4), i64([0])
    for args in ((i64([1]), i64([2]), inv, ends, 5), (i64([1]), i64([2]), inv, i64([0, 0]), 4),
                 (i64([1]), i64([2]), torch.zeros(4, dtype=torch.int32), ends, 4), (i64([1]), i64([2]), inv, ends, 0)):
        with pytest.raises((TypeError, ValueError)):
            fn(*args)
    assert inv.tolist() == [0] * 4 and ends.tolist() == [0]
