"""hostcopy: host arrays packed into one copy and a paged prefix cache's export (hand vectors, and on
random blocks against the slots built on the host)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcanary.hostcopy import export_of_blocks, packed
from kvcanary_schema import NO_SLOT


def test_packed_keeps_each_part_and_the_flags() -> None:
    ints, flags = packed((np.array([3, -1]), np.array([], dtype=np.int64), np.array([7])), np.array([True, False]),
                         torch.device("cpu"))
    assert ints.dtype == torch.int64 and ints.tolist() == [3, -1, 7]
    assert flags is not None and flags.dtype == torch.bool and flags.tolist() == [True, False]
    only, none = packed((np.array([5]),), None, torch.device("cpu"))
    assert only.tolist() == [5] and none is None


@pytest.mark.parametrize("unlocked", [None, np.array([False, True, True])])
def test_export_of_blocks_hand_vector(unlocked: np.ndarray | None) -> None:
    """Pages of 2 slots: block 4 (first, position 0), block 1 after it (position 2), block 9 (first of another
    sequence)."""
    e = export_of_blocks(np.array([4, 1, 9]), np.array([0, 2, 0]), np.array([-1, 4, -1]), 2, unlocked,
                         torch.device("cpu"))
    e.validate(torch.device("cpu"))
    assert e.slots.tolist() == [8, 9, 2, 3, 18, 19]
    assert e.starts.tolist() == [0, 2, 4] and e.lens.tolist() == [2, 2, 2]
    assert e.first_positions.tolist() == [0, 2, 0] and e.prev_slots.tolist() == [NO_SLOT, 9, NO_SLOT]
    assert (e.unlocked is None) if unlocked is None else e.unlocked.tolist() == [False, True, True]


def test_export_of_no_blocks() -> None:
    e = export_of_blocks(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), 16, None,
                         torch.device("cpu"))
    e.validate(torch.device("cpu"))
    assert e.num_chains == 0 and e.slots.numel() == 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 10_000), max_size=40, unique=True), st.sampled_from([1, 2, 16]))
def test_export_slots_are_each_blocks_page(blocks: list[int], page: int) -> None:
    """Block b's chain is slots [b * page, (b + 1) * page), chains back to back: the slots the host would build."""
    b = np.array(blocks, dtype=np.int64)
    n = b.shape[0]
    e = export_of_blocks(b, np.zeros(n, np.int64), np.full(n, -1, np.int64), page, None, torch.device("cpu"))
    e.validate(torch.device("cpu"))
    assert e.slots.tolist() == [s for x in blocks for s in range(x * page, (x + 1) * page)]
    assert e.starts.tolist() == list(range(0, n * page, page)) and e.lens.tolist() == [page] * n
