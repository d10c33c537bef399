"""stage_batch: hand vectors, torch vs C++ CPU vs a list model, padding, bad arguments."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcanary.errors import CanaryInputError
from kvcanary.ops.stage_batch import stage_batch

BACKENDS = ["torch", "cpu"]


def model(src: list[list[int]], staging: list[list[int]], rows: list[list[int]], truth: list[list[int]],
          tokens: list[list[int]], pad_rows: int, pad_tokens: int, padding_row: int) -> None:
    """The contract on Python lists (in place)."""
    bs, nt = len(src[0]), len(src[3])
    for i in range(pad_rows):
        for r in range(3):
            rows[r][i] = src[r][i] if i < bs else (padding_row if r == 0 else 0)
        if i < bs:
            for u, row in enumerate(staging):
                truth[u][i] = row[i]
    for k in range(pad_tokens):
        if k < nt:
            for r in range(3):
                tokens[r][k] = src[3 + r][k]
        else:
            tokens[2][k] = -1


def run(backend: str, src: list[list[int]], staging: list[list[int]], rows: list[list[int]], truth: list[list[int]],
        tokens: list[list[int]], pad_rows: int, pad_tokens: int, padding_row: int,
        i32: tuple[bool, ...] = (False,) * 6) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    t = [torch.tensor(v, dtype=torch.int32 if small else torch.int64) for v, small in zip(src, i32, strict=True)]
    out = [torch.tensor(v, dtype=torch.int64) for v in (rows, truth, tokens)]
    stage_batch(t, torch.tensor(staging, dtype=torch.int64), *out, pad_rows, pad_tokens, padding_row, backend=backend)
    return out[0].tolist(), out[1].tolist(), out[2].tolist()


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_vector(backend: str) -> None:
    src = [[3, 1], [7, 0], [1, 4], [11, 12, 13, 14, 15], [7, 0, 1, 2, 3], [40, 41, 42, 43, 44]]
    staging = [[5, 6, 99], [-1, 8, 99]]
    rows = [[9] * 4 for _ in range(3)]
    truth = [[9] * 4 for _ in range(2)]
    tokens = [[9] * 7 for _ in range(3)]
    got = run(backend, src, staging, rows, truth, tokens, pad_rows=3, pad_tokens=6, padding_row=-1,
              i32=(True, False, True, False, True, False))
    assert got == ([[3, 1, -1, 9], [7, 0, 0, 9], [1, 4, 0, 9]], [[5, 6, 9, 9], [-1, 8, 9, 9]],
                   [[11, 12, 13, 14, 15, 9, 9], [7, 0, 1, 2, 3, 9, 9], [40, 41, 42, 43, 44, -1, 9]])


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_empty_batch_only_pads(backend: str) -> None:
    got = run(backend, [[], [], [], [], [], []], [[]], [[1, 2], [3, 4], [5, 6]], [[7, 8]], [[1], [2], [3]],
              pad_rows=2, pad_tokens=1, padding_row=0)
    assert got == ([[0, 0], [0, 0], [0, 0]], [[7, 8]], [[1], [2], [-1]])


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31))
def test_torch_cpu_and_model_agree(seed: int) -> None:
    rng = random.Random(seed)
    bs, nt, u = rng.randint(0, 9), rng.randint(0, 20), rng.randint(1, 5)
    rc, tc = bs + rng.randint(0, 6), nt + rng.randint(0, 9)
    src = [[rng.randrange(-(1 << 31), 1 << 31) for _ in range(bs if i < 3 else nt)] for i in range(6)]
    cols = bs + rng.randint(0, 3)
    staging = [[rng.randrange(-(1 << 62), 1 << 62) for _ in range(cols)] for _ in range(u)]
    rows, truth, tokens = ([[rng.randrange(-50, 50) for _ in range(c)] for _ in range(n)]
                           for n, c in ((3, rc), (u, rc), (3, tc)))
    pad_rows, pad_tokens, padding_row = rng.randint(bs, rc), rng.randint(nt, tc), rng.randint(-1, 30)
    i32 = tuple(rng.random() < 0.5 for _ in range(6))
    want = [[list(r) for r in x] for x in (rows, truth, tokens)]
    model(src, staging, *want, pad_rows, pad_tokens, padding_row)
    for backend in BACKENDS:
        assert run(backend, src, staging, rows, truth, tokens, pad_rows, pad_tokens, padding_row, i32) == tuple(want)


def _args() -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    z = torch.zeros
    return ([z(2, dtype=torch.int64)] * 3 + [z(3, dtype=torch.int64)] * 3, z(5, 4, dtype=torch.int64),
            z(3, 4, dtype=torch.int64), z(5, 4, dtype=torch.int64), z(3, 6, dtype=torch.int64))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["float_src", "short_prefix", "long_positions", "2d_src", "pad_rows_low",
                                  "pad_rows_high", "pad_tokens_low", "pad_tokens_high", "staging_narrow",
                                  "staging_rows", "truth_cols", "rows_shape", "tokens_dtype", "five_src"])
def test_bad_arguments_raise_before_any_write(backend: str, case: str) -> None:
    src, staging, rows, truth, tokens = _args()
    pads = {"pad_rows": 3, "pad_tokens": 4}
    if case == "float_src":
        src[0] = src[0].float()
    elif case == "short_prefix":
        src[1] = src[1][:1]
    elif case == "long_positions":
        src[4] = torch.zeros(4, dtype=torch.int64)
    elif case == "2d_src":
        src[3] = torch.zeros(1, 3, dtype=torch.int64)
    elif case == "staging_narrow":
        staging = staging[:, :1].contiguous()
    elif case == "staging_rows":
        staging = staging[:4]
    elif case == "truth_cols":
        truth = truth[:, :3].contiguous()
    elif case == "rows_shape":
        rows = torch.zeros(2, 4, dtype=torch.int64)
    elif case == "tokens_dtype":
        tokens = tokens.to(torch.int32)
    elif case == "five_src":
        src = src[:5]
    else:
        which, bad = case.rsplit("_", 1)
        pads[which] = {"low": {"pad_rows": 1, "pad_tokens": 2}, "high": {"pad_rows": 5, "pad_tokens": 7}}[bad][which]
    before = [t.clone() for t in (rows, truth, tokens)]
    with pytest.raises(CanaryInputError):
        stage_batch(src, staging, rows, truth, tokens, pads["pad_rows"], pads["pad_tokens"], -1, backend=backend)
    assert all(torch.equal(a, b) for a, b in zip(before, (rows, truth, tokens), strict=True))
