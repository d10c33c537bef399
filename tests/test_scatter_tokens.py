"""scatter_tokens: hand vectors, torch vs C++ CPU vs a Python-int model, skipped requests, bad arguments."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcanary import _native
from kvcanary.errors import CanaryInputError
from kvcanary.ops.scatter_tokens import scatter_tokens
from kvcanary.ops.types import TokenPool

BACKENDS = ["torch", "cpu"]


def model(pool: list[list[int]], lens: list[int], rows: list[int], starts: list[int], counts: list[int],
          tokens: list[int]) -> int:
    """The contract with Python lists; returns the number of skipped requests."""
    off = errors = 0
    for r, s, c in zip(rows, starts, counts, strict=True):
        if 0 <= r < len(pool) and s >= 0 and c >= 0 and s + c <= len(pool[r]) and off + c <= len(tokens):
            pool[r][s:s + c] = tokens[off:off + c]
            lens[r] = s + c
        else:
            errors += 1
        off += min(max(c, 0), len(tokens) + 1)
    return errors


def run(backend: str, pool: list[list[int]], lens: list[int], rows: list[int], starts: list[int],
        counts: list[int], tokens: list[int], offset: int = 0) -> tuple[list[list[int]], list[int], int]:
    tp = TokenPool(torch.tensor(pool, dtype=torch.int64), torch.tensor(lens, dtype=torch.int64), offset)
    status = torch.tensor([5], dtype=torch.int64)
    scatter_tokens(tp, torch.tensor(rows, dtype=torch.int64), torch.tensor(starts, dtype=torch.int64),
                   torch.tensor(counts, dtype=torch.int64), torch.tensor(tokens, dtype=torch.int64), status,
                   backend=backend)
    return tp.tokens.tolist(), tp.lens.tolist(), int(status[0]) - 5


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_vector(backend: str) -> None:
    pool, lens = [[0] * 6 for _ in range(3)], [0, 2, 0]
    got = run(backend, pool, lens, [1, 0], [2, 0], [3, 1], [7, 8, 9, 4])
    assert got == ([[4, 0, 0, 0, 0, 0], [0, 0, 7, 8, 9, 0], [0] * 6], [1, 5, 0], 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_invalid_requests_are_skipped_and_counted(backend: str) -> None:
    pool, lens = [[0] * 4 for _ in range(2)], [1, 1]
    # row 5 (out of range) still advances the token offset by its count; start + count past the row; negative
    # count (advances nothing); tokens exhausted.
    rows, starts, counts = [5, 0, 1, 1, 0, 1], [0, 3, 0, -1, 0, 0], [2, 2, -4, 1, 1, 3]
    tokens = [10, 11, 12, 13, 14, 15, 16]
    got = run(backend, pool, lens, rows, starts, counts, tokens)
    p, ln = [[0] * 4 for _ in range(2)], [1, 1]
    errors = model(p, ln, rows, starts, counts, tokens)
    assert errors == 5
    assert got == (p, ln, errors)
    assert got[0][0][0] == 15  # request 4 took tokens[5]: offset 2 + 2 + 0 + 1 (invalid counts still advance)
    assert got[1] == [1, 1]  # request 5 (3 tokens from offset 6 of 7) was skipped


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(0, 9), bad=st.sampled_from([0.0, 0.2, 0.6]))
def test_torch_cpu_and_model_agree(seed: int, n: int, bad: float) -> None:
    rng = random.Random(seed)
    num_rows, width = rng.randrange(1, 12), rng.randrange(1, 20)
    pool = [[rng.randrange(100) for _ in range(width)] for _ in range(num_rows)]
    lens = [rng.randrange(width + 1) for _ in range(num_rows)]
    rows = rng.sample(range(num_rows), min(n, num_rows))  # distinct rows: no write order ambiguity
    rows = [r if rng.random() >= bad else rng.choice([-1, num_rows, 1 << 40]) for r in rows]
    starts = [rng.randrange(width + 1) if rng.random() >= bad else rng.choice([-2, width, width + 3]) for _ in rows]
    counts = [rng.randrange(width - s + 1) if 0 <= s <= width and rng.random() >= bad else rng.randrange(-3, width + 3)
              for s in starts]
    tokens = [rng.randrange(1000) for _ in range(sum(max(c, 0) for c in counts) - (rng.random() < bad))]
    p, ln = [list(r) for r in pool], list(lens)
    errors = model(p, ln, rows, starts, counts, tokens)
    for backend in BACKENDS:
        assert run(backend, pool, lens, rows, starts, counts, tokens) == (p, ln, errors), backend


@pytest.mark.parametrize("backend", BACKENDS)
def test_status_accumulates(backend: str) -> None:
    tp = TokenPool(torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))
    status = torch.zeros(1, dtype=torch.int64)
    bad_row = torch.tensor([7])
    for _ in range(3):
        scatter_tokens(tp, bad_row, torch.tensor([0]), torch.tensor([1]), torch.tensor([3]), status, backend=backend)
    assert int(status[0]) == 3


@pytest.mark.parametrize(("arg", "value", "match"), [
    ("rows", torch.zeros(2, dtype=torch.int32), "rows"),
    ("starts", torch.zeros(3, dtype=torch.int64), "starts"),
    ("counts", torch.zeros(2, 1, dtype=torch.int64), "counts"),
    ("tokens", torch.zeros(4, dtype=torch.int64)[::2], "tokens"),
    ("status", torch.zeros(2, dtype=torch.int64), "status"),
    ("pool", "pool", "TokenPool"),
    ("backend", "cuda", "cuda"),
])
def test_wrapper_rejects_bad_arguments(arg: str, value: object, match: str) -> None:
    args: dict[str, object] = {
        "pool": TokenPool(torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)),
        "rows": torch.zeros(2, dtype=torch.int64), "starts": torch.zeros(2, dtype=torch.int64),
        "counts": torch.zeros(2, dtype=torch.int64), "tokens": torch.zeros(2, dtype=torch.int64),
        "status": torch.zeros(1, dtype=torch.int64)}
    args[arg] = value
    with pytest.raises(CanaryInputError, match=match):
        scatter_tokens(**args)  # type: ignore[arg-type]


def test_native_entry_rejects_bad_arguments() -> None:
    mod = _native.module("cpu")
    z = torch.zeros(2, dtype=torch.int64)
    pool = torch.zeros(2, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="pool_lens"):
        mod.scatter_tokens(pool, torch.zeros(3, dtype=torch.int64), z, z, z, z, torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="status"):
        mod.scatter_tokens(pool, z, z, z, z, z, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(TypeError, match="int64"):
        mod.scatter_tokens(pool, z, z.int(), z, z, z, torch.zeros(1, dtype=torch.int64))
