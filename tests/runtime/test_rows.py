"""RequestRows: claims (new, moved, evicted requests), the rows that ran, stale requests and the window's live slots."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcanary.rows import RequestRows


def _claim(r: RequestRows, rows: list[int], keys: list[object]) -> tuple[list[bool], list[int]]:
    ra, ka = np.array(rows, np.int64), np.array(keys, dtype=object)
    idx = np.flatnonzero(r.unclaimed(ra, ka, np.not_equal(ka, None)))
    new, reset = r.claim(ra, ka, idx)
    return new.tolist(), reset


def test_new_moved_and_evicted_requests() -> None:
    r = RequestRows(4)
    assert _claim(r, [1, 2], ["a", "b"]) == ([True, True], [1, 2])
    assert _claim(r, [1, 2], ["a", "b"]) == ([], [])  # both hold their rows: nothing to claim
    # a moves to row 3 (not new; row 1 is left), c takes b's row 2 (b is evicted)
    assert _claim(r, [3, 2], ["a", "c"]) == ([False, True], [1, 3, 2])
    assert r.owner.tolist() == [None, None, "c", "a"]
    assert _claim(r, [2], ["b"]) == ([True], [2])  # b lost its row: new again
    assert r.drop("a") == 3 and r.owner[3] is None and r.drop("a") is None


def test_padding_rows_are_never_claimed() -> None:
    r = RequestRows(3)
    assert _claim(r, [0, 1], [None, "a"]) == ([True], [1])
    assert r.owner[0] is None


def test_stale_and_live_slots() -> None:
    r = RequestRows(4)
    _claim(r, [1, 2, 3], ["a", "b", "c"])
    r.ran(np.array([1, 2, 3]), np.array([True, True, False]), np.array([10, 20, 30]), step=5)
    r.ran(np.array([1]), np.array([True]), np.array([11]), step=9)
    assert r.live_slots(since=0) == 11 + 20 and r.live_slots(since=5) == 11
    assert r.stale(step=9, horizon=3) == ["b", "c"]  # b last ran at 5, c never did
    r.drop("a")
    assert r.live_slots(since=5) == 11  # a row that ran in the window still counts after its request left


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3)), max_size=4), max_size=12))
def test_owner_map_matches_a_dict_model(forwards: list[list[tuple[int, int]]]) -> None:
    """Every request holds at most one row and every held row names its request, as a plain dict model says."""
    r, model = RequestRows(4), {}  # model: request -> row
    for fwd in forwards:
        pairs = {row: key for key, row in fwd}  # one request per row in a forward
        keys = {}
        for row, key in pairs.items():
            keys.setdefault(key, row)
        pairs = {row: key for key, row in keys.items()}
        rows, ks = list(pairs), [f"r{k}" for k in pairs.values()]
        new, _ = _claim(r, rows, ks)
        expect_new = [k not in model for row, k in zip(rows, ks, strict=True) if model.get(k) != row]  # at its start
        assert new == expect_new
        for row, k in zip(rows, ks, strict=True):
            model = {kk: rr for kk, rr in model.items() if rr != row}
            model[k] = row
        assert {k: i for i, k in enumerate(r.owner.tolist()) if k is not None} == model
