"""slot_rows (docs/ops-contract.md 12): hand vector, the native op against the torch reference (seeded and property),
bad input raised before anything is written."""

from __future__ import annotations

import random
from typing import cast

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcanary.errors import CanaryInputError
from kvcanary.ops.slot_rows import bind_slot_rows, slot_rows
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_bound_equals_the_call(backend: str) -> None:
    """bind_slot_rows (static arguments checked once, per-call tensors unchecked on a native backend) fills and
    converts exactly as the torch reference, case by case."""
    for seed in range(150):
        case = _case(random.Random(seed))
        want = _run(case, "torch")
        c = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
        bound = bind_slot_rows(c["table"], c["stride"], c["page"], backend)  # type: ignore[arg-type]
        bound(*(c[k] for k in ("rows", "starts", "lens", "src", "out", "write")))  # type: ignore[arg-type]
        assert torch.equal(c["table"], want[0]) and torch.equal(c["out"], want[1]), f"seed {seed}"  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", BACKENDS)
def test_bound_bad_input_raises_before_anything_is_written(backend: str) -> None:
    """A bad static argument fails at binding; a bad per-call tensor (checked natively on a native backend) raises
    CanaryInputError with nothing written."""
    table, out = torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    for args, match in [((torch.zeros(3, dtype=torch.int64), 4, 2), "dims"), ((table, 4, 5), "page <= stride"),
                        ((table, 0, 1), "stride"), ((table.float(), 4, 2), "dtype")]:
        with pytest.raises(CanaryInputError, match=match):
            bind_slot_rows(*args, backend=backend)  # type: ignore[arg-type]
    bound = bind_slot_rows(table, 4, 2, backend)
    good = {"rows": i64([0]), "starts": i64([0]), "lens": i64([2]), "src": i64([1, 2]), "out": out,
            "write": i64([3, 4])}
    bad = [("rows", torch.zeros(1, dtype=torch.int32)), ("starts", i64([0, 1])), ("src", torch.zeros(2)),
           ("write", i64([1])), ("out", torch.zeros(2, dtype=torch.int32)), ("lens", i64([[2]]))]
    for key, value in bad:
        with pytest.raises(CanaryInputError):
            bound(**{**good, key: value})  # type: ignore[arg-type]
    assert not table.any() and not out.any()
    bound(**good)  # type: ignore[arg-type]
    assert table[0, :2].tolist() == [1, NO_SLOT] and out.tolist() == [NO_SLOT, 2]  # stride 4, page 2
