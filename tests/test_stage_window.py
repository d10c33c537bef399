"""stage_window (docs/ops-contract.md 13): hand vector, the CPU op against the torch reference (seeded and property) on
views of one arena as the canary passes them, the reference against the contract as a plain loop, bad input raised
before anything is written."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcanary.errors import CanaryInputError
from kvcanary.ops.stage_window import WindowStager, stage_window

BACKENDS = ["torch", "cpu"]


def arena_case(rng: random.Random) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """An arena [head | rows] with the count and the reset inside the head (the canary's layout, at random sizes),
    its views and the defined length of dst (head and the kept rows)."""
    cap, c = rng.randint(0, 6), rng.randint(1, 4)
    h = rng.randint(1, 9)
    arena = torch.tensor([rng.randint(-50, 50) for _ in range(h + cap * c)], dtype=torch.int64)
    at = rng.randrange(h)
    count = rng.choice([-3, 0, 1, cap, cap + 4, rng.randint(0, cap)])
    arena[at] = count
    r0 = rng.randint(0, h)
    reset = arena[r0:rng.randint(r0, h)]
    views = {"head": arena[:h], "count": arena[at:at + 1], "rows": arena[h:].view(cap, c), "reset": reset}
    return arena, views, 1 + h + min(max(count, 0), cap) * c


def run(arena: torch.Tensor, views: dict[str, torch.Tensor], tag: int, backend: str) -> tuple[torch.Tensor, ...]:
    """(dst, the arena after) of one call on copies (dst starts at -7 everywhere)."""
    a = arena.clone()
    v = {k: a[t.storage_offset():t.storage_offset() + t.numel()].view(t.shape) for k, t in views.items()}
    dst = torch.full((1 + arena.numel(),), -7, dtype=torch.int64)
    stage_window(v["head"], v["count"], v["rows"], v["reset"], dst, tag, backend=backend)
    return dst, a


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_vector(backend: str) -> None:
    """Head [phase 5, counter 9, count 2, status 4], rows of 2: two of three rows kept, count and status reset."""
    arena = torch.tensor([5, 9, 2, 4, 10, 11, 20, 21, 30, 31])
    dst = torch.full((11,), -7, dtype=torch.int64)
    stage_window(arena[:4], arena[2:3], arena[4:].view(3, 2), arena[2:4], dst, 123, backend=backend)
    assert dst[:9].tolist() == [123, 5, 9, 2, 4, 10, 11, 20, 21]
    assert arena.tolist() == [5, 9, 0, 0, 10, 11, 20, 21, 30, 31]


def test_cpu_op_equals_reference_seeded() -> None:
    for seed in range(300):
        arena, views, n = arena_case(random.Random(seed))
        (got, arena_got), (want, arena_want) = run(arena, views, seed + 1, "cpu"), run(arena, views, seed + 1, "torch")
        assert torch.equal(got[:n], want[:n]) and torch.equal(arena_got, arena_want), seed
        assert bool((got[n:] == -7).all()), seed  # the native op leaves the entries past the kept rows


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31))
def test_cpu_op_equals_reference_property(seed: int) -> None:
    arena, views, n = arena_case(random.Random(seed))
    (got, arena_got), (want, arena_want) = run(arena, views, -seed, "cpu"), run(arena, views, -seed, "torch")
    assert torch.equal(got[:n], want[:n]) and torch.equal(arena_got, arena_want)


def test_reference_against_a_plain_loop() -> None:
    """The torch reference against the contract written element by element (the oracle checked)."""
    for seed in range(200):
        arena, views, n = arena_case(random.Random(seed))
        dst, after = run(arena, views, 77, "torch")
        head, rows = views["head"].tolist(), views["rows"].flatten().tolist()
        cap = views["rows"].shape[0]
        k = min(max(int(views["count"][0]), 0), cap)
        want = [77, *head, *rows[:k * views["rows"].shape[1]]]
        assert dst[:n].tolist() == want and len(want) == n, seed
        expect = arena.clone()
        r = views["reset"]
        expect[r.storage_offset():r.storage_offset() + r.numel()] = 0
        assert torch.equal(after, expect), seed


@pytest.mark.parametrize("backend", BACKENDS)
def test_stager_alternates_destinations(backend: str) -> None:
    arena = torch.tensor([1, 3, 8, 9, 6, 6])  # head [1, count 3]; 4 rows of 1, 3 kept
    dsts = [torch.zeros(7, dtype=torch.int64) for _ in range(2)]
    stager = WindowStager(arena[:2], arena[1:2], arena[2:].view(4, 1), arena[1:2], dsts, backend)
    stager(1, 5)
    assert dsts[1][:6].tolist() == [5, 1, 3, 8, 9, 6] and dsts[0].tolist() == [0] * 7 and int(arena[1]) == 0
    arena[1] = 1
    stager(0, 6)
    assert dsts[0][:4].tolist() == [6, 1, 1, 8] and dsts[1][0] == 5


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_raises_before_anything_is_written(backend: str) -> None:
    arena = torch.arange(10, dtype=torch.int64)
    head, count, rows, reset = arena[:4], arena[2:3], arena[4:].view(3, 2), arena[2:4]
    dst = torch.zeros(11, dtype=torch.int64)
    bad = [
        ((head, count, rows, reset, torch.zeros(10, dtype=torch.int64)), "dst"),  # wrong length
        ((head, count, rows, reset, dst.view(11, 1)), "dst"),
        ((head, arena[2:4], rows, reset, dst), "count"),
        ((head.float(), count, rows, reset, dst), "head"),
        ((head, count, arena[4:], reset, dst), "rows"),
        ((head, count, rows, reset, torch.zeros(22, dtype=torch.int64)[::2]), "dst"),
    ]
    big = torch.zeros(20, dtype=torch.int64)  # dst overlapping the arena it stages
    bad.append(((big[:4], big[2:3], big[4:10].view(3, 2), big[2:4], big[9:20]), "overlap"))
    for args, match in bad:
        with pytest.raises(CanaryInputError, match=match):
            stage_window(*args, 1, backend=backend)  # type: ignore[arg-type]
    assert torch.equal(arena, torch.arange(10)) and int(dst.abs().sum()) == 0 and int(big.abs().sum()) == 0
    if backend == "cpu":  # the native entry checks again
        from kvcanary import _native  # noqa: PLC0415

        for args, _ in bad:
            with pytest.raises((TypeError, ValueError)):
                _native.module("cpu").stage_window(*args, 1)
        assert torch.equal(arena, torch.arange(10)) and int(big.abs().sum()) == 0
