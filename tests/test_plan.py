"""plan_forward / plan_sweep: a Python-int oracle of the contract against the torch reference and the CPU backend."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcanary import _native
from kvcanary.errors import CanaryInputError
from kvcanary.ops.plan import plan_forward, plan_sweep
from kvcanary_schema import NO_SLOT, NUM_PLAN_COLS, NUM_PLAN_STATUS_COLS, PlanCol, PlanFlag, PlanStatusCol

BACKENDS = ("torch", "cpu")
BIG = 1 << 62


# ---- oracle: docs/ops-contract.md 2-3, literally, on Python ints ------------------------------------------------

def oracle_forward(rpi: list[int], pre: list[int], ext: list[int], table: list[list[int]], num_tokens: int,
                   window: int = 0, padding_row: int = -1, ep: list[int] | None = None,
                   en: list[int] | None = None, fm: list[int] | None = None) -> tuple[list[list[int]], list[int]]:
    R = len(table)
    L = len(table[0]) if table else 0
    segs: list[list[int]] = []
    status = [0] * NUM_PLAN_STATUS_COLS
    tok = 0
    for i in range(len(rpi)):
        row, p, e = rpi[i], pre[i], ext[i]
        wb = tok
        if e >= 0:
            tok += e
        if padding_row >= 0 and row == padding_row:
            if row < R and 0 < e and wb + e <= num_tokens:  # a PADDING segment: its tokens' slots get checked
                r = [0] * NUM_PLAN_COLS
                r[PlanCol.BATCH_INDEX], r[PlanCol.ROW], r[PlanCol.PREFIX_LEN] = i, row, p
                r[PlanCol.ENTRY_OFFSET] = status[PlanStatusCol.VERIFY_ENTRIES]
                r[PlanCol.FIRST_PREV_SLOT], r[PlanCol.SEED_SLOT] = NO_SLOT, NO_SLOT
                r[PlanCol.WRITE_BEGIN], r[PlanCol.WRITE_LEN] = wb, e
                r[PlanCol.FLAGS] = PlanFlag.FIRST_IS_HEAD | PlanFlag.SEED_IS_HEAD | PlanFlag.PADDING
                if fm is not None:
                    r[PlanCol.FLAGS] &= fm[i]
                segs.append(r)
                status[PlanStatusCol.WRITE_ENTRIES] += e
            continue
        if not (0 <= row < R and 0 <= p and 0 <= e and p + e <= L):
            status[PlanStatusCol.INPUT_ERRORS] += 1
            continue
        if wb + e > num_tokens:
            status[PlanStatusCol.INPUT_ERRORS] += 1
            status[PlanStatusCol.OVERFLOW] = 1
            continue
        vb = max(0, p - window) if window > 0 else 0
        r = [0] * NUM_PLAN_COLS
        r[PlanCol.BATCH_INDEX], r[PlanCol.ROW], r[PlanCol.IDX_BEGIN], r[PlanCol.IDX_END] = i, row, vb, p
        r[PlanCol.ENTRY_OFFSET] = status[PlanStatusCol.VERIFY_ENTRIES]
        r[PlanCol.FIRST_PREV_SLOT] = table[row][vb - 1] if vb > 0 else NO_SLOT
        r[PlanCol.WRITE_BEGIN], r[PlanCol.WRITE_LEN] = wb, e
        r[PlanCol.SEED_SLOT] = table[row][p - 1] if p > 0 else NO_SLOT
        r[PlanCol.PREFIX_LEN] = p
        r[PlanCol.EXPECT_PREFIX] = ep[i] if ep is not None else 0
        r[PlanCol.EXPECT_NEW] = en[i] if en is not None else 0
        r[PlanCol.FLAGS] = ((PlanFlag.FIRST_IS_HEAD if vb == 0 else 0) | (PlanFlag.SEED_IS_HEAD if p == 0 else 0)
                            | (PlanFlag.EXPECT_PREFIX if ep is not None else 0)
                            | (PlanFlag.EXPECT_NEW if en is not None else 0))
        if fm is not None:
            r[PlanCol.FLAGS] &= fm[i]
        segs.append(r)
        status[PlanStatusCol.VERIFY_ENTRIES] += p - vb
        status[PlanStatusCol.WRITE_ENTRIES] += e
    status[PlanStatusCol.NUM_SEGMENTS] = len(segs)
    return segs, status


def oracle_sweep(n_slots: int, starts: list[int], lens: list[int], firsts: list[int], prevs: list[int],
                 ee: list[int] | None = None) -> tuple[list[list[int]], list[int]]:
    segs: list[list[int]] = []
    status = [0] * NUM_PLAN_STATUS_COLS
    for c in range(len(starts)):
        s, n, f = starts[c], lens[c], firsts[c]
        if s < 0 or n < 0 or s + n > n_slots or f < 0:
            status[PlanStatusCol.INPUT_ERRORS] += 1
            continue
        r = [0] * NUM_PLAN_COLS
        r[PlanCol.BATCH_INDEX], r[PlanCol.ROW], r[PlanCol.IDX_BEGIN], r[PlanCol.IDX_END] = c, 0, s, s + n
        r[PlanCol.POS_SHIFT], r[PlanCol.ENTRY_OFFSET] = f - s, status[PlanStatusCol.VERIFY_ENTRIES]
        r[PlanCol.FIRST_PREV_SLOT], r[PlanCol.SEED_SLOT], r[PlanCol.PREFIX_LEN] = prevs[c], NO_SLOT, f + n
        r[PlanCol.EXPECT_PREFIX] = ee[c] if ee is not None else 0
        r[PlanCol.FLAGS] = ((PlanFlag.FIRST_IS_HEAD if prevs[c] == NO_SLOT else 0)
                            | (PlanFlag.EXPECT_PREFIX if ee is not None else 0))
        segs.append(r)
        status[PlanStatusCol.VERIFY_ENTRIES] += n
    status[PlanStatusCol.NUM_SEGMENTS] = len(segs)
    return segs, status


def i64(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def run_forward(backend: str, cap: int, rpi: list[int], pre: list[int], ext: list[int], table: torch.Tensor,
                num_tokens: int, **kw: Any) -> tuple[list[list[int]], list[int]]:
    plan = torch.full((cap, NUM_PLAN_COLS), 777, dtype=torch.int64)
    status = torch.full((NUM_PLAN_STATUS_COLS,), 555, dtype=torch.int64)
    kw = {k: (i64(v) if isinstance(v, list) else v) for k, v in kw.items()}
    plan_forward(plan, status, i64(rpi), i64(pre), i64(ext), table, num_tokens, backend=backend, **kw)
    n = int(status[PlanStatusCol.NUM_SEGMENTS])
    return plan[:n].tolist(), status.tolist()


def run_sweep(backend: str, cap: int, n_slots: int, starts: list[int], lens: list[int], firsts: list[int],
              prevs: list[int], ee: list[int] | None = None) -> tuple[list[list[int]], list[int]]:
    plan = torch.full((cap, NUM_PLAN_COLS), 777, dtype=torch.int64)
    status = torch.full((NUM_PLAN_STATUS_COLS,), 555, dtype=torch.int64)
    slots = torch.arange(n_slots, dtype=torch.int64)
    plan_sweep(plan, status, slots, i64(starts), i64(lens), i64(firsts), i64(prevs),
               expect_end=None if ee is None else i64(ee), backend=backend)
    n = int(status[PlanStatusCol.NUM_SEGMENTS])
    return plan[:n].tolist(), status.tolist()


# ---- hand-computed ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_hand_case(backend: str) -> None:
    table = torch.arange(3 * 6, dtype=torch.int32).view(3, 6) + 100
    # req 0: row 2, prefix 4, 1 new; req 1: padding row 0; req 2: row 1, prefix 0, 3 new; req 3: bad row 7.
    segs, status = run_forward(backend, 8, [2, 0, 1, 7], [4, 5, 0, 1], [1, 1, 3, 1], table, 6, window=3,
                               padding_row=0, expect_new=[11, 12, 13, 14])
    assert status == [3, 3, 5, 1, 0]
    fph, sh, en = int(PlanFlag.FIRST_IS_HEAD), int(PlanFlag.SEED_IS_HEAD), int(PlanFlag.EXPECT_NEW)
    # req 0: vb = 4 - 3 = 1, first prev = table[2, 0] = 112, seed = table[2, 3] = 115, write begin 0.
    assert segs[0] == [0, 2, 1, 4, 0, 0, 112, 0, 1, 115, 4, 0, 11, en]
    # req 1 (padding row): a PADDING segment of its one token, no verify range, no seed, no expectations.
    assert segs[1] == [1, 0, 0, 0, 0, 3, NO_SLOT, 1, 1, NO_SLOT, 5, 0, 0, fph | sh | int(PlanFlag.PADDING)]
    # req 2: tokens before it: 1 (req 0) + 1 (padding row) = 2.
    assert segs[2] == [2, 1, 0, 0, 0, 3, NO_SLOT, 2, 3, NO_SLOT, 0, 0, 13, fph | sh | en]


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_flag_mask_hand_case(backend: str) -> None:
    """Each request's rows keep only the flags of its mask; values stay; a padding segment is masked too."""
    table = torch.arange(2 * 4, dtype=torch.int64).view(2, 4) + 50
    ep, en = int(PlanFlag.EXPECT_PREFIX), int(PlanFlag.EXPECT_NEW)
    segs, _ = run_forward(backend, 4, [1, 1, 0], [2, 0, 0], [1, 1, 1], table, 3, padding_row=0, expect_prefix=[7, 8, 9],
                          expect_new=[4, 5, 6], flag_mask=[~ep, -1, ~int(PlanFlag.PADDING)])
    fh, sh = int(PlanFlag.FIRST_IS_HEAD), int(PlanFlag.SEED_IS_HEAD)
    assert [s[PlanCol.FLAGS] for s in segs] == [fh | en, fh | sh | ep | en, fh | sh]
    assert [(s[PlanCol.EXPECT_PREFIX], s[PlanCol.EXPECT_NEW]) for s in segs] == [(7, 4), (8, 5), (0, 0)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_overflow_and_huge_values(backend: str) -> None:
    table = torch.zeros(2, 4, dtype=torch.int64)
    # A huge extend on an invalid request still advances the offset: everything after it overflows.
    segs, status = run_forward(backend, 4, [0, 5, 1, 0], [1, 0, 1, 0], [2, BIG, 1, 0], table, 10)
    assert status == [1, 1, 2, 3, 1]
    assert [s[PlanCol.BATCH_INDEX] for s in segs] == [0]
    # A negative extend does not advance the offset; pre + ext past int64 is out of range, not wrapped.
    segs, status = run_forward(backend, 4, [0, 1, 1], [BIG, 1, 3], [-5, 3, (1 << 63) - 2], table, 10)
    assert status == [1, 1, 3, 2, 0]
    assert segs[0][PlanCol.WRITE_BEGIN] == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reuse", [False, True])
def test_forward_tick_once_per_call_and_the_plan_unchanged(backend: str, reuse: bool) -> None:
    """The stage counter rides in the call: each element +1 per call (also with the reuse plan in the same launch,
    also for a batch of input errors only); the plan and status are those of the call without it."""
    a = _forward_args()
    kw: dict[str, Any] = {"reuse": (torch.zeros(4, NUM_PLAN_COLS, dtype=torch.int64),
                                    torch.zeros(NUM_PLAN_STATUS_COLS, dtype=torch.int64), i64([1, 0]))} if reuse else {}
    plain = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in a.items()}
    plan_forward(**plain, **kw, backend=backend)
    tick = i64([41, -3, 0])
    for n in range(1, 4):
        plan_forward(**a, **kw, tick=tick, backend=backend)
        assert tick.tolist() == [41 + n, -3 + n, n]
    assert torch.equal(a["plan"], plain["plan"]) and torch.equal(a["status"], plain["status"])
    bad = {**_forward_args(), "req_pool_indices": i64([9, 9])}  # rows outside the table: input errors only
    plan_forward(**bad, tick=tick, backend=backend)
    assert tick.tolist() == [45, 1, 4]


def test_forward_tick_bad_args(no_native: None) -> None:
    a = _forward_args()
    for tick, match in ((torch.zeros(2, 1, dtype=torch.int64), "tick"), (torch.zeros(2, dtype=torch.int32), "tick"),
                        (a["status"][:2], "overlap")):
        with pytest.raises(CanaryInputError, match=match):
            plan_forward(**a, tick=tick, backend="cpu")
    assert not a["status"].any() and not a["plan"].any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_sweep_hand_case(backend: str) -> None:
    segs, status = run_sweep(backend, 4, 10, [0, 4, 8, -1], [4, 3, 3, 1], [0, 9, 0, 0], [NO_SLOT, 3, 5, 0],
                             ee=[7, 8, 9, 10])
    assert status == [2, 7, 0, 2, 0]
    fph, ep = int(PlanFlag.FIRST_IS_HEAD), int(PlanFlag.EXPECT_PREFIX)
    assert segs[0] == [0, 0, 0, 4, 0, 0, NO_SLOT, 0, 0, NO_SLOT, 4, 7, 0, fph | ep]
    assert segs[1] == [1, 0, 4, 7, 5, 4, 3, 0, 0, NO_SLOT, 12, 8, 0, ep]


# ---- differential: oracle vs torch vs cpu ----------------------------------------------------------------------

def _random_forward(rng: random.Random) -> dict[str, Any]:
    R, L = rng.randint(1, 6), rng.randint(0, 9)
    bs = rng.randint(0, 9)
    dtype = rng.choice([torch.int32, torch.int64])
    table = torch.tensor([[rng.randint(-3, 40) for _ in range(L)] for _ in range(R)], dtype=dtype).view(R, L)

    def val(lo: int, hi: int) -> int:
        r = rng.random()
        return rng.choice([-1, -BIG, BIG, hi + 1]) if r < 0.08 else rng.randint(lo, hi)

    rpi = [val(-1, R) for _ in range(bs)]
    pre = [val(0, L) for _ in range(bs)]
    ext = [val(0, max(L - p, 0)) if 0 <= p <= L else val(0, 3) for p in pre]
    kw: dict[str, Any] = {"window": rng.choice([0, 0, 1, 2, 5]), "padding_row": rng.choice([-1, -1, 0, R - 1])}
    if rng.random() < 0.5:
        kw["expect_prefix"] = [rng.getrandbits(63) - (1 << 62) for _ in range(bs)]
    if rng.random() < 0.5:
        kw["expect_new"] = [rng.getrandbits(63) - (1 << 62) for _ in range(bs)]
    if rng.random() < 0.5:  # the runtime's masks (keep all, drop either EXPECT_* flag) and arbitrary bits
        kw["flag_mask"] = [rng.choice([-1, ~int(PlanFlag.EXPECT_PREFIX), ~int(PlanFlag.EXPECT_NEW),
                                       rng.getrandbits(63) - (1 << 62)]) for _ in range(bs)]
    total = sum(max(e, 0) for e in ext if e < BIG)
    num_tokens = rng.choice([total, total + 2, max(0, total - rng.randint(0, 3))])
    return {"rpi": rpi, "pre": pre, "ext": ext, "table": table, "num_tokens": num_tokens, **kw}


def _check_forward(case: dict[str, Any], cap_extra: int) -> None:
    kw = {k: case[k] for k in ("window", "padding_row", "expect_prefix", "expect_new", "flag_mask") if k in case}
    want = oracle_forward(case["rpi"], case["pre"], case["ext"], case["table"].tolist(), case["num_tokens"],
                          kw.get("window", 0), kw.get("padding_row", -1), kw.get("expect_prefix"),
                          kw.get("expect_new"), kw.get("flag_mask"))
    cap = len(case["rpi"]) + cap_extra
    for backend in BACKENDS:
        got = run_forward(backend, cap, case["rpi"], case["pre"], case["ext"], case["table"], case["num_tokens"],
                          **kw)
        assert got == want, backend


def test_forward_fuzz_seeded() -> None:
    rng = random.Random(1234)
    for _ in range(300):
        _check_forward(_random_forward(rng), rng.randint(0, 3))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32))
def test_forward_property(seed: int) -> None:
    rng = random.Random(seed)
    _check_forward(_random_forward(rng), rng.randint(0, 2))


def _check_reuse_fold(case: dict[str, Any], rng: random.Random) -> None:
    """plan_forward with reuse=(...) writes the main plan unchanged and, in its reuse buffers, exactly the separate
    plan_forward of (reuse_lens, no new tokens, window 0, no expected values)."""
    kw = {k: case[k] for k in ("window", "padding_row", "expect_prefix", "expect_new", "flag_mask") if k in case}
    bs, cap = len(case["rpi"]), len(case["rpi"]) + rng.randint(0, 2)
    reuse_lens = [rng.choice([0, 0, -1, BIG, rng.randint(0, 9)]) for _ in range(bs)]
    want_main = run_forward("torch", cap, case["rpi"], case["pre"], case["ext"], case["table"], case["num_tokens"],
                            **kw)
    want_reuse = run_forward("torch", cap, case["rpi"], reuse_lens, [0] * bs, case["table"], case["num_tokens"],
                             padding_row=kw.get("padding_row", -1))
    for backend in BACKENDS:
        rp = torch.full((cap, NUM_PLAN_COLS), 777, dtype=torch.int64)
        rs = torch.full((NUM_PLAN_STATUS_COLS,), 555, dtype=torch.int64)
        got_main = run_forward(backend, cap, case["rpi"], case["pre"], case["ext"], case["table"],
                               case["num_tokens"], reuse=(rp, rs, i64(reuse_lens)), **kw)
        n = int(rs[PlanStatusCol.NUM_SEGMENTS])
        assert got_main == want_main, backend
        assert (rp[:n].tolist(), rs.tolist()) == want_reuse, backend


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32))
def test_forward_reuse_fold_property(seed: int) -> None:
    rng = random.Random(seed)
    _check_reuse_fold(_random_forward(rng), rng)


def test_forward_reuse_bad_args(no_native: None) -> None:
    a = _forward_args()
    rp, rs = torch.zeros_like(a["plan"]), torch.zeros_like(a["status"])
    for reuse, match in [((rp, rs), "tuple"), ((a["plan"], rs, a["prefix_lens"]), "other buffers"),
                         ((rp, a["status"], a["prefix_lens"]), "other buffers"),
                         ((rp[:1], rs, a["prefix_lens"]), "rows"), ((rp, rs, a["prefix_lens"][:1]), "reuse_lens"),
                         ((rp, rs[:2], a["prefix_lens"]), "reuse_status")]:
        with pytest.raises(CanaryInputError, match=match):
            plan_forward(**a, reuse=reuse)


def _random_sweep(rng: random.Random) -> tuple[int, list[int], list[int], list[int], list[int], list[int] | None]:
    n_slots, n = rng.randint(0, 30), rng.randint(0, 12)

    def val(lo: int, hi: int) -> int:
        return rng.choice([-1, -5, BIG, hi + 3]) if rng.random() < 0.08 else rng.randint(lo, max(lo, hi))

    starts = [val(0, n_slots) for _ in range(n)]
    lens = [val(0, n_slots - s) if 0 <= s <= n_slots else val(0, 3) for s in starts]
    firsts = [val(0, 50) for _ in range(n)]
    prevs = [rng.choice([NO_SLOT, NO_SLOT, -7, rng.randint(0, 40)]) for _ in range(n)]
    ee = [rng.getrandbits(64) - (1 << 63) for _ in range(n)] if rng.random() < 0.5 else None
    return n_slots, starts, lens, firsts, prevs, ee


def test_sweep_fuzz_seeded() -> None:
    rng = random.Random(99)
    for _ in range(300):
        n_slots, starts, lens, firsts, prevs, ee = _random_sweep(rng)
        want = oracle_sweep(n_slots, starts, lens, firsts, prevs, ee)
        for backend in BACKENDS:
            assert run_sweep(backend, len(starts) + rng.randint(0, 2), n_slots, starts, lens, firsts, prevs,
                             ee) == want, backend


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32))
def test_sweep_property(seed: int) -> None:
    rng = random.Random(seed)
    n_slots, starts, lens, firsts, prevs, ee = _random_sweep(rng)
    want = oracle_sweep(n_slots, starts, lens, firsts, prevs, ee)
    for backend in BACKENDS:
        assert run_sweep(backend, len(starts), n_slots, starts, lens, firsts, prevs, ee) == want, backend


def test_forward_status_overwritten_and_entry_offsets_are_a_prefix_sum() -> None:
    rng = random.Random(5)
    for _ in range(50):
        case = _random_forward(rng)
        for backend in BACKENDS:
            kw = {k: case[k] for k in ("window", "padding_row") if k in case}
            segs, status = run_forward(backend, len(case["rpi"]), case["rpi"], case["pre"], case["ext"],
                                       case["table"], case["num_tokens"], **kw)
            off = 0
            for s in segs:  # invariants that do not trust the oracle
                assert s[PlanCol.ENTRY_OFFSET] == off
                assert 0 <= s[PlanCol.IDX_BEGIN] <= s[PlanCol.IDX_END] <= case["table"].shape[1]
                assert s[PlanCol.WRITE_BEGIN] + s[PlanCol.WRITE_LEN] <= case["num_tokens"]
                off += s[PlanCol.IDX_END] - s[PlanCol.IDX_BEGIN]
            assert status[PlanStatusCol.VERIFY_ENTRIES] == off
            bad = status[PlanStatusCol.INPUT_ERRORS]
            pads = sum(1 for r in case["rpi"] if kw.get("padding_row", -1) >= 0 and r == kw["padding_row"])
            pad_segs = sum(1 for s in segs if s[PlanCol.FLAGS] & PlanFlag.PADDING)
            assert status[PlanStatusCol.NUM_SEGMENTS] - pad_segs + bad + pads == len(case["rpi"])


# ---- bad arguments ---------------------------------------------------------------------------------------------

@pytest.fixture
def no_native(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(kind: str) -> None:
        raise AssertionError("native module reached despite a bad argument")
    monkeypatch.setattr(_native, "module", boom)


def _forward_args() -> dict[str, Any]:
    return {"plan": torch.zeros(4, NUM_PLAN_COLS, dtype=torch.int64),
            "status": torch.zeros(NUM_PLAN_STATUS_COLS, dtype=torch.int64),
            "req_pool_indices": i64([0, 1]), "prefix_lens": i64([1, 2]), "extend_lens": i64([1, 1]),
            "req_to_token": torch.zeros(2, 5, dtype=torch.int32), "num_tokens": 2}


def _bad_variants(name: str, t: torch.Tensor) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = [("dtype", t.to(torch.float32)), ("type", t.tolist())]
    if t.dim() == 1:
        out.append(("shape", t.repeat(2) if t.numel() else torch.zeros(3, dtype=t.dtype)))
        out.append(("ndim", t.view(1, -1)))
        out.append(("contiguity", t.repeat_interleave(2)[::2] if t.numel() else t.view(1, 0).t()))
    else:
        out.append(("shape", t[:, :-1].contiguous() if name in ("plan",) else t.view(-1)))
        out.append(("contiguity", t.t() if t.shape[0] > 1 and t.shape[1] > 1 else t.view(-1)))
    out.append(("device", t.to("meta")))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["plan", "status", "req_pool_indices", "prefix_lens", "extend_lens",
                                  "req_to_token", "expect_prefix", "expect_new"])
def test_forward_bad_tensor_args(name: str, backend: str, no_native: None) -> None:
    base = _forward_args()
    base["expect_prefix"], base["expect_new"] = i64([1, 2]), i64([3, 4])
    for what, bad in _bad_variants(name, base[name]):
        if name == "req_to_token" and what == "shape":
            continue  # any [R, L] is a valid table
        if name == "req_pool_indices" and what == "shape":
            continue  # it defines bs; the others are checked against it
        args = dict(base, **{name: bad})
        # req_pool_indices defines the device: on another one, the first tensor compared with it is named.
        match = "prefix_lens" if (name, what) == ("req_pool_indices", "device") else name
        with pytest.raises(CanaryInputError, match=match):
            plan_forward(**args, backend=backend)


@pytest.mark.parametrize("kw", [{"num_tokens": -1}, {"window": -2}, {"padding_row": -2}, {"backend": "gpu"},
                                {"plan": torch.zeros(1, NUM_PLAN_COLS, dtype=torch.int64)}, {"window": 1.5}])
def test_forward_bad_scalars(kw: dict[str, Any], no_native: None) -> None:
    args = dict(_forward_args(), backend="cpu")
    args.update(kw)
    with pytest.raises(CanaryInputError):
        plan_forward(**args)


@pytest.mark.parametrize("name", ["plan", "status", "slots", "starts", "lens", "first_positions", "prev_slots",
                                  "expect_end"])
def test_sweep_bad_tensor_args(name: str, no_native: None) -> None:
    base: dict[str, Any] = {"plan": torch.zeros(3, NUM_PLAN_COLS, dtype=torch.int64),
                            "status": torch.zeros(NUM_PLAN_STATUS_COLS, dtype=torch.int64),
                            "slots": torch.arange(6), "starts": i64([0, 2]), "lens": i64([2, 2]),
                            "first_positions": i64([0, 2]), "prev_slots": i64([NO_SLOT, 1]),
                            "expect_end": i64([5, 6])}
    for what, bad in _bad_variants(name, base[name]):
        if name in ("slots", "starts") and what == "shape":
            continue  # they define N and n
        match = "starts" if (name, what) == ("slots", "device") else name
        with pytest.raises(CanaryInputError, match=match):
            plan_sweep(**dict(base, **{name: bad}), backend="cpu")
    with pytest.raises(CanaryInputError, match="plan"):
        plan_sweep(**dict(base, plan=torch.zeros(1, NUM_PLAN_COLS, dtype=torch.int64)), backend="cpu")


def test_native_entry_validates_again() -> None:
    m = _native.module("cpu")
    a = _forward_args()
    e = torch.empty(0, dtype=torch.int64)
    call = [a["plan"], a["status"], a["req_pool_indices"], a["prefix_lens"], a["extend_lens"], a["req_to_token"],
            e, 0, e, 0, e, 0, 2, 0, -1, 1, e, e, e, 0, e]
    m.plan_forward(*call)
    reuse = list(call)
    reuse[16:20] = [torch.zeros_like(a["plan"]), torch.zeros_like(a["status"]), a["prefix_lens"].clone(), 1]
    m.plan_forward(*reuse)
    for k, bad in [(0, torch.zeros(1, NUM_PLAN_COLS, dtype=torch.int64)), (1, torch.zeros(3, dtype=torch.int64)),
                   (3, i64([1])), (4, a["extend_lens"].to(torch.int32)), (5, torch.zeros(2, 5)),
                   (6, i64([1])), (7, 1), (10, i64([1])), (10, i64([1, 2]).to(torch.int32)), (11, 1), (12, -1),
                   (13, -1), (14, -3), (15, 0), (15, 1 << 40), (20, torch.zeros(2, 1, dtype=torch.int64)),
                   (20, torch.zeros(2, dtype=torch.int32))]:
        bad_call = list(call)
        bad_call[k] = bad
        with pytest.raises((ValueError, TypeError)):
            m.plan_forward(*bad_call)
    for k, bad in [(16, torch.zeros(1, NUM_PLAN_COLS, dtype=torch.int64)), (17, torch.zeros(3, dtype=torch.int64)),
                   (18, i64([1])), (18, a["prefix_lens"].to(torch.int32))]:
        bad_call = list(reuse)
        bad_call[k] = bad
        with pytest.raises((ValueError, TypeError)):
            m.plan_forward(*bad_call)
    sw = [torch.zeros(2, NUM_PLAN_COLS, dtype=torch.int64), a["status"], torch.arange(5), i64([0, 1]), i64([1, 1]),
          i64([0, 0]), i64([-1, -1]), e, 0]
    m.plan_sweep(*sw)
    for k, bad in [(0, torch.zeros(1, NUM_PLAN_COLS, dtype=torch.int64)), (4, i64([1])), (6, i64([1, 2, 3])),
                   (7, i64([1, 2, 3])), (8, 1)]:
        bad_call = list(sw)
        bad_call[k] = bad
        with pytest.raises((ValueError, TypeError)):
            m.plan_sweep(*bad_call)
