"""hostcopy: host arrays packed into one copy, staged rows, and a paged prefix cache's export (hand vectors, and on
random blocks against the slots built on the host)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcanary.errors import CanaryInputError
from kvcanary.hostcopy import StagedRows, export_of_blocks, packed
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


def staged_rows_round_trip(device: torch.device) -> None:
    """Each put's views hold its values; a later, narrower put overwrites the front and leaves the views' length."""
    rows = StagedRows(3, 8, device)
    a = rows.put(([1, 2, 3], [4, 5, 6], [7, 8, 9]), 3)
    assert [v.tolist() for v in a] == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert all(v.is_contiguous() and v.dtype == torch.int64 and v.device.type == device.type for v in a)
    b = rows.put(np.array([[-1], [-2], [-3]]), 1)
    assert [v.tolist() for v in b] == [[-1], [-2], [-3]]
    assert [h.tolist() for h in rows.host_rows(1)] == [[-1], [-2], [-3]]
    assert all(h.flags.c_contiguous and h.dtype == np.int64 for h in rows.host_rows(3))
    assert rows.put(([5, 6, 7], [0, 0, 0], [1, 1, 1]), 3)[0].tolist() == [5, 6, 7]
    assert [v.numel() for v in rows.put(((), (), ()), 0)] == [0, 0, 0]
    with pytest.raises(CanaryInputError, match="at most 8"):
        rows.put(([0] * 9, [0] * 9, [0] * 9), 9)


def test_staged_rows_round_trip() -> None:
    staged_rows_round_trip(torch.device("cpu"))
