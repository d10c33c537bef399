"""slot_rows and stage_slot_rows (docs/ops-contract.md 12, 12a): hand vectors, the native ops against the torch
references (seeded and property) and the references against plain loops, the bound stager, bad input raised before
anything is written."""

from __future__ import annotations

import random
from typing import Any, cast

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcanary.errors import CanaryInputError
from kvcanary.ops.slot_rows import FACT_ROWS, SlotRowStager, slot_rows, stage_slot_rows
from kvcanary_schema import NO_SLOT

BACKENDS = ["torch", "cpu"]


def i64(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_vector(backend: str) -> None:
    """Blocks of stride 6, 4 token slots each (rows 4 and 5 of a block are no token slot); 2 requests, table width 3."""
    table = torch.full((3, 3), 77, dtype=torch.int64)
    src = i64([0, 3, 6, 13,  # request 0 (row 2): block 0 offsets 0, 3; block 1 offset 0 -> 4; block 2 offset 1 -> 9
               5, -1])       # request 1 (row 0): offset 5 (no token slot), negative
    out = torch.zeros(4, dtype=torch.int64)
    slot_rows(table, i64([2, 0]), i64([0, 4]), i64([4, 2]), src, out, i64([7, 10, -3, 12]), 6, 4, backend=backend)
    # request 0 has 4 positions, the table 3 columns: the 4th is not filled; row 1 is untouched
    assert table.tolist() == [[NO_SLOT, NO_SLOT, 77], [77, 77, 77], [0, 3, 4]]
    assert out.tolist() == [5, NO_SLOT, NO_SLOT, 8]  # 7: block 1 offset 1; 10: offset 4; 12: block 2 offset 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_named_twice_keeps_the_last_request_per_position(backend: str) -> None:
    """Requests 0 and 2 name row 1 (3 and 1 positions), request 1 names it with a segment past src (fills nothing):
    position 0 is request 2's, positions 1-2 request 0's (stride = page: slots map to themselves)."""
    table = torch.full((2, 4), 77, dtype=torch.int64)
    src = i64([10, 11, 12, 20])
    out = torch.zeros(0, dtype=torch.int64)
    slot_rows(table, i64([1, 1, 1]), i64([0, 3, 3]), i64([3, 9, 1]), src, out, i64([]), 5, 5, backend=backend)
    assert table.tolist() == [[77] * 4, [20, 11, 12, 77]]


def _case(rng: random.Random) -> dict[str, object]:
    stride = rng.randint(1, 9)
    page = rng.randint(1, stride)
    R, L = rng.randint(1, 6), rng.randint(1, 12)
    bs = rng.randint(0, 7)
    lens = [rng.randint(-1, 14) for _ in range(bs)]
    m = max(0, sum(max(x, 0) for x in lens) + rng.randint(-3, 3))
    starts, at = [], 0
    for x in lens:
        starts.append(at + rng.choice([0, 0, 0, -1, 2]))
        at += max(x, 0)
    rows = [rng.randint(-1, R) for _ in range(bs)]
    big = rng.random() < 0.2
    hi = 2**33 if big else 60
    src = [rng.randint(-3, hi) for _ in range(m)]
    n = rng.randint(0, 10)
    write = [rng.randint(-3, hi) for _ in range(n)]
    tdt = rng.choice([torch.int32, torch.int64])
    sdt = torch.int64 if big else rng.choice([torch.int32, torch.int64])
    return {"table": torch.randint(-5, 99, (R, L), dtype=tdt), "rows": i64(rows), "starts": i64(starts),
            "lens": i64(lens), "src": torch.tensor(src, dtype=sdt), "out": torch.full((n,), 5, dtype=torch.int64),
            "write": torch.tensor(write, dtype=sdt), "stride": stride, "page": page}


def _run(case: dict[str, object], backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    c = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    slot_rows(**c, backend=backend)  # type: ignore[arg-type]
    return c["table"], c["out"]  # type: ignore[return-value]


def _check(seed: int) -> None:
    case = _case(random.Random(seed))
    want, got = _run(case, "torch"), _run(case, "cpu")
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]), f"seed {seed}"


def test_native_equals_reference_seeded() -> None:
    for seed in range(300):
        _check(seed)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32))
def test_native_equals_reference_property(seed: int) -> None:
    _check(seed)


def _slot(s: int, stride: int, page: int, i32: bool) -> int:
    """The contract's slot(s), one id at a time."""
    v = s - (s // stride) * (stride - page) if s >= 0 and s % stride < page else NO_SLOT
    return NO_SLOT if i32 and v > 2**31 - 1 else v


def test_reference_against_a_python_loop() -> None:
    """The torch reference against the contract written as a plain loop (the oracle checked)."""
    for seed in range(100):
        case = _case(random.Random(seed))
        table, out = _run(case, "torch")
        want = cast(torch.Tensor, case["table"]).clone()
        stride, page = cast(int, case["stride"]), cast(int, case["page"])
        src = cast(torch.Tensor, case["src"]).tolist()
        rows, starts, lens = (cast(torch.Tensor, case[k]).tolist() for k in ("rows", "starts", "lens"))
        i32 = want.dtype == torch.int32
        for row, start, n in zip(rows, starts, lens, strict=True):
            if 0 <= row < want.shape[0] and start >= 0 and n >= 0 and start + n <= len(src):
                for j in range(min(n, want.shape[1])):
                    want[row, j] = _slot(src[start + j], stride, page, i32)
        assert torch.equal(table, want), f"seed {seed}"
        writes = cast(torch.Tensor, case["write"]).tolist()
        assert out.tolist() == [_slot(x, stride, page, False) for x in writes], f"seed {seed}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_raises_before_anything_is_written(backend: str) -> None:
    table, out = torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    good = {"table": table, "rows": i64([0]), "starts": i64([0]), "lens": i64([2]), "src": i64([1, 2]), "out": out,
            "write": i64([3, 4]), "stride": 4, "page": 2}
    bad = [("table", torch.zeros(3, dtype=torch.int64), "dims"), ("rows", torch.zeros(1, dtype=torch.int32), "dtype"),
           ("starts", i64([0, 1]), "shape"), ("src", torch.zeros(2, dtype=torch.float32), "dtype"),
           ("write", i64([1]), "shape"), ("page", 5, "page <= stride"), ("stride", 0, "stride"),
           ("out", torch.zeros(2, dtype=torch.int32), "dtype")]
    for key, value, match in bad:
        with pytest.raises(CanaryInputError, match=match):
            slot_rows(**{**good, key: value}, backend=backend)  # type: ignore[arg-type]
    assert not table.any() and not out.any()


# ---- stage_slot_rows (12a) ---------------------------------------------------------------------------------------

def _facts(rows: list[int], pre: list[int], ext: list[int]) -> np.ndarray:
    return np.array([rows, pre, ext], dtype=np.int64).reshape(3, len(rows))


def _buffers(width: int, same: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(staging, facts), both -9 everywhere; ``same``: facts is staging itself."""
    staging = torch.full((FACT_ROWS, width), -9, dtype=torch.int64)
    return staging, staging if same else staging.clone()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("same", [False, True])
def test_stage_hand_vector(backend: str, same: bool) -> None:
    """test_hand_vector's batch given as facts: rows [2, 0], prefix [1, 3], extend [3, -1] stage kv [4, 2] and starts
    [0, 4] (so lens and starts as there), the columns past the batch untouched."""
    table = torch.full((3, 3), 77, dtype=torch.int64)
    src = i64([0, 3, 6, 13, 5, -1])
    out = torch.zeros(4, dtype=torch.int64)
    staging, facts = _buffers(3, same)
    stage_slot_rows(table, _facts([2, 0], [1, 3], [3, -1]), staging, facts, src, out, i64([7, 10, -3, 12]), 6, 4,
                    backend=backend)
    assert table.tolist() == [[NO_SLOT, NO_SLOT, 77], [77, 77, 77], [0, 3, 4]]
    assert out.tolist() == [5, NO_SLOT, NO_SLOT, 8]
    for t in (staging, facts):
        assert t.tolist() == [[2, 0, -9], [1, 3, -9], [3, -1, -9], [4, 2, -9], [0, 4, -9]]


def _stage_case(rng: random.Random) -> dict[str, Any]:
    """A slot_rows case whose row facts come as (rows, prefix, extend): segments back to back, src a few slots off."""
    c = _case(rng)
    bs = cast(torch.Tensor, c["rows"]).shape[0]
    kv = [rng.randint(-2, 9) for _ in range(bs)]
    pre = [rng.randint(-3, 12) for _ in range(bs)]
    ext = [k - p for k, p in zip(kv, pre, strict=True)]
    m = max(0, sum(kv) + rng.randint(-3, 3))
    src = cast(torch.Tensor, c["src"])
    c["src"] = torch.randint(-3, 60, (m,), generator=torch.Generator().manual_seed(rng.randint(0, 99)),
                             dtype=src.dtype)
    c["facts_in"] = _facts(cast(torch.Tensor, c.pop("rows")).tolist(), pre, ext)
    del c["starts"], c["lens"]
    width = bs + rng.randint(0, 3)
    c["staging"], c["facts"] = _buffers(width, rng.random() < 0.5)
    return c


def _run_stage(case: dict[str, Any], backend: str) -> tuple[torch.Tensor, ...]:
    c = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    if case["facts"] is case["staging"]:
        c["facts"] = c["staging"]
    stage_slot_rows(**c, backend=backend)
    return c["table"], c["out"], c["staging"], c["facts"]


def test_stage_native_equals_reference_and_slot_rows() -> None:
    """The CPU op against the torch reference, and both against slot_rows of the facts staged by a plain loop (the
    oracle checked)."""
    for seed in range(300):
        case = _stage_case(random.Random(seed))
        want = _run_stage(case, "torch")
        got = _run_stage(case, "cpu")
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True)), f"seed {seed}"
        rows, pre, ext = case["facts_in"].tolist()
        kv = [p + e for p, e in zip(pre, ext, strict=True)]
        starts = [sum(kv[:i]) for i in range(len(kv))]
        bs = len(rows)
        assert want[3][:, :bs].tolist() == [rows, pre, ext, kv, starts]
        assert torch.equal(want[2][:, :bs], want[3][:, :bs])
        plain = {k: v.clone() for k, v in case.items() if k in ("table", "src", "out", "write")}
        slot_rows(plain["table"], i64(rows), i64(starts), i64(kv), plain["src"], plain["out"], plain["write"],
                  case["stride"], case["page"])
        assert torch.equal(plain["table"], want[0]) and torch.equal(plain["out"], want[1]), f"seed {seed}"


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32))
def test_stage_native_equals_reference_property(seed: int) -> None:
    case = _stage_case(random.Random(seed))
    want, got = _run_stage(case, "torch"), _run_stage(case, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_stage_bad_input_raises_before_anything_is_written(backend: str) -> None:
    table, out = torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    staging, facts = _buffers(2, False)
    good: dict[str, Any] = {"table": table, "facts_in": _facts([0], [1], [1]), "staging": staging, "facts": facts,
                            "src": i64([1, 2]), "out": out, "write": i64([3, 4]), "stride": 4, "page": 2}
    big = 2**62
    bad = [("facts_in", _facts([0], [1], [1]).astype(np.int32), "int64"), ("facts_in", np.zeros((2, 1), np.int64), ""),
           ("facts_in", np.zeros((3, 4), np.int64)[:, ::2], "contiguous"), ("staging", staging[:3], ""),
           ("facts", facts[:, :1], ""), ("facts_in", _facts([0, 0, 0], [0] * 3, [0] * 3), "columns"),
           ("facts_in", _facts([0], [big], [big]), "int64"), ("event", 5, "event"),
           ("facts_in", _facts([0, 1], [big, big], [big // 2, big // 2]), "int64"),
           ("staging", staging.to(torch.int32), ""), ("src", torch.zeros(2), ""), ("write", i64([1]), ""),
           ("page", 5, "page <= stride")]
    for key, value, match in bad:
        with pytest.raises(CanaryInputError, match=match or None):
            stage_slot_rows(**{**good, key: value}, backend=backend)
    assert not table.any() and not out.any() and (staging == -9).all() and (facts == -9).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_stager_equals_the_call(backend: str) -> None:
    """SlotRowStager (static arguments checked once, per-call tensors unchecked on a native backend; on the CPU the
    facts are the staging) fills, converts and stages exactly as the torch reference, and hands out the device facts'
    rows, prefix and extend lengths, case by case."""
    for seed in range(150):
        case = _stage_case(random.Random(seed))
        case["facts"] = case["staging"] = _buffers(case["staging"].shape[1], True)[0]
        want = _run_stage(case, "torch")
        table = case["table"].clone()
        out = case["out"].clone()
        stager = SlotRowStager(table, case["stride"], case["page"], case["staging"].shape[1], backend)
        got = stager(case["facts_in"], case["src"], out, case["write"])
        assert torch.equal(table, want[0]) and torch.equal(out, want[1]), f"seed {seed}"
        bs = case["facts_in"].shape[1]
        assert [v.tolist() for v in got] == case["facts_in"].tolist(), f"seed {seed}"
        assert torch.equal(stager.facts[:, :bs], want[3][:, :bs]), f"seed {seed}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_stager_bad_input_raises_before_anything_is_written(backend: str) -> None:
    """A bad static argument fails at construction; a bad per-call argument (checked natively on a native backend)
    raises CanaryInputError with nothing written; a good call then works, and a narrower one reuses the front."""
    table, out = torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    for args, match in [((torch.zeros(3, dtype=torch.int64), 4, 2, 2), "dims"), ((table, 4, 5, 2), "page <= stride"),
                        ((table, 0, 1, 2), "stride"), ((table.float(), 4, 2, 2), "dtype"),
                        ((table, 4, 2, -1), "width")]:
        with pytest.raises(CanaryInputError, match=match):
            SlotRowStager(*args, backend=backend)
    stager = SlotRowStager(table, 4, 2, 2, backend)
    good: dict[str, Any] = {"facts_in": _facts([0], [0], [2]), "src": i64([1, 2]), "out": out, "write": i64([3, 4])}
    bad = [("facts_in", _facts([0, 1, 1], [0] * 3, [0] * 3)), ("facts_in", _facts([0], [2**62], [2**62])),
           ("src", torch.zeros(2)), ("write", i64([1])), ("out", torch.zeros(2, dtype=torch.int32))]
    for key, value in bad:
        with pytest.raises(CanaryInputError):
            stager(**{**good, key: value})
    assert not table.any() and not out.any() and not stager.staging.any()
    rows, pre, ext = stager(**good)
    assert table[0, :2].tolist() == [1, NO_SLOT] and out.tolist() == [NO_SLOT, 2]  # stride 4, page 2
    assert (rows.tolist(), pre.tolist(), ext.tolist()) == ([0], [0], [2])
    assert [v.numel() for v in stager(_facts([], [], []), i64([]), out[:0], i64([]))] == [0, 0, 0]
