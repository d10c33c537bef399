"""Token truth in bulk: RowChains (numpy, per slot-table row) against ChainHasher + chain_truth as the oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcanary import _native
from kvcanary.errors import CanaryInputError
from kvcanary.ops import hashes as H
from kvcanary.ops.stage_batch import BAD_VALUE, NOT_STEADY, begin_decode
from kvcanary.rows import RequestRows
from kvcanary.truth import BatchTruth, ChainHasher, RowChains, chain_g_np, chain_truth
from kvcanary.upload import KEEP_ALL, NO_NEW

ROWS = 6


def _g_oracle(t: int, p: int) -> int:
    return H.chain_step_int(0, t, p)  # h = 0: g(t, p) alone


def test_chain_g_np_matches_python_ints() -> None:
    rng = np.random.default_rng(0)
    toks, pos = rng.integers(0, 1 << 31, 64), rng.integers(0, 1 << 31, 64)
    got = chain_g_np(toks, pos).tolist()
    assert got == [_g_oracle(int(t), int(p)) for t, p in zip(toks, pos, strict=True)]


# A forward: per request (key index, row, prefix, new tokens); histories grow, may be rewound or move rows.
_forward = st.lists(st.tuples(st.integers(0, 4), st.integers(0, ROWS - 1), st.integers(0, 3), st.booleans()),
                    min_size=1, max_size=4)


def _native_chains(rows: int, offset: int = 0) -> RowChains:
    """The chains as the runtime builds them on a native backend (both host ops)."""
    cpu = _native.module("cpu")
    return RowChains(rows, offset, cpu.hash_chain_step, cpu.truth_segments)


def _steady_truth(chains: RowChains, rows: np.ndarray, live: np.ndarray, pre: np.ndarray, ext: np.ndarray,
                  new: np.ndarray, backend: str = "cpu", declines: int = NOT_STEADY) -> BatchTruth | None:
    """begin_decode's staging rows read back as a BatchTruth (None: it declined with ``declines``, and must have
    changed nothing)."""
    before = (chains.h.copy(), chains.n.copy())
    bs, nt = rows.shape[0], new.shape[0]
    staging = torch.full((5, bs + 3), 7, dtype=torch.int64)  # wider than the batch: columns past it stay untouched
    src = [torch.from_numpy(np.asarray(v, np.int64)) for v in (rows, pre, ext)]
    src += [torch.zeros(nt, dtype=torch.int64)] * 3
    dst = (torch.zeros(3, bs + 3, dtype=torch.int64), torch.zeros(5, bs + 3, dtype=torch.int64),
           torch.zeros(3, nt + 2, dtype=torch.int64))
    seen, prefix = np.zeros_like(chains.n), np.zeros_like(chains.n)
    got = begin_decode(src, staging, *dst, bs, nt, 0, (rows, pre, ext), new, live, chains.h.view(np.int64), chains.n,
                       chains.offset, seen, prefix, 1, backend=backend)
    if got < 0:
        assert got == declines and (staging == 7).all() and not any(d.any() for d in dst)
        assert (chains.h == before[0]).all() and (chains.n == before[1]).all()
        return None
    staging = staging.numpy()
    unknown = got
    assert (staging[:, rows.shape[0]:] == 7).all() and not staging[3:, :rows.shape[0]].any()
    mask = staging[2, :rows.shape[0]]
    new_known = live & (mask == KEEP_ALL)
    assert set(mask.tolist()) <= {KEEP_ALL, NO_NEW} and int(np.count_nonzero(live & ~new_known)) == unknown
    return BatchTruth(staging[0, :rows.shape[0]], staging[1, :rows.shape[0]], live & (pre > 0), new_known)


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(_forward, min_size=1, max_size=8), offset=st.integers(0, 1), seed=st.integers(0, 2**16),
       bulk=st.booleans(), native=st.sampled_from(["no", "step", "segments", "decode"]))
def test_row_chains_equal_chain_hasher(steps: list[list[tuple[int, int, int, bool]]], offset: int, seed: int,
                                       bulk: bool, native: str) -> None:
    """Every path (numpy, the native step, the native segments, the native steady decode) against the oracle,
    forward by forward."""
    rng = np.random.default_rng(seed)
    hist = {k: [int(t) for t in rng.integers(0, 1000, int(rng.integers(4, 30)))] for k in range(5)}  # truth known
    done = dict.fromkeys(range(5), 0)  # tokens each request has in its KV so far
    oracle = ChainHasher(offset)
    chains = _native_chains(ROWS, offset) if native in ("segments", "decode") else \
        RowChains(ROWS, offset, _native.module("cpu").hash_chain_step if native == "step" else None)
    requests = RequestRows(ROWS)  # the rows' owners, as Upload keeps them
    for fwd in steps:
        seen: dict[int, tuple[int, int, int]] = {}
        for key, row, ext, rewind in fwd:
            if key in seen or row in {r for r, _, _ in seen.values()}:
                continue
            pre = max(0, done[key] - 2) if rewind else done[key]
            seen[key] = (row, pre, ext)
        keys = list(seen)
        rows = np.array([seen[k][0] for k in keys], np.int64)
        pre = np.array([seen[k][1] for k in keys], np.int64)
        ext = np.array([seen[k][2] for k in keys], np.int64)
        known = [len(hist[k]) for k in keys]
        new = [hist[k][p + j + offset] if p + j + offset < n else -1
               for k, p, e, n in zip(keys, pre.tolist(), ext.tolist(), known, strict=True) for j in range(e)]
        histories = [hist[k] for k in keys]
        karr, live = np.array(keys, dtype=object), np.ones(len(keys), bool)
        claims = np.flatnonzero(requests.unclaimed(rows, karr, live))
        chains.reset(requests.claim(rows, karr, claims)[1])
        steady = bulk and native == "decode" and not claims.size
        got = _steady_truth(chains, rows, live, pre, ext, np.array(new, np.int64)) if steady else None
        if got is None:
            got = chains.forward(rows, live, pre, ext, np.array(new, np.int64) if bulk else None, histories)
        for i, k in enumerate(keys):
            ep, en = chain_truth(oracle, k, hist[k], int(pre[i]), int(ext[i]), offset)
            assert (bool(got.prefix_known[i]), int(got.expect_prefix[i]) if got.prefix_known[i] else None) == \
                (ep is not None, ep), (i, k)
            assert (bool(got.new_known[i]), int(got.expect_new[i]) if got.new_known[i] else None) == \
                (en is not None, en), (i, k)
            done[k] = int(pre[i] + ext[i])


def test_padding_rows_are_left_alone() -> None:
    chains = RowChains(4)
    got = chains.forward(np.array([0, 1]), np.array([False, True]), np.array([0, 0]), np.array([2, 2]),
                         np.array([5, 6, 7, 8]), [(), (7, 8)])
    assert not got.prefix_known.any() and got.new_known.tolist() == [False, True]
    assert (chains.h[0], chains.n[0]) == (H.CHAIN_H0, 0) and chains.n[1] == 2


@pytest.mark.parametrize("native", ["no", "step", "segments"])
@pytest.mark.parametrize("ext", [1, 3])
def test_bad_true_token_raises_and_changes_nothing(native: str, ext: int) -> None:
    cpu = _native.module("cpu")
    chains = RowChains(2, 0, cpu.hash_chain_step if native != "no" else None,
                       cpu.truth_segments if native == "segments" else None)
    chains.forward(np.array([1]), np.array([True]), np.array([0]), np.array([1]), None, [(3,)])
    before = (chains.h.copy(), chains.n.copy())
    with pytest.raises(CanaryInputError):
        chains.forward(np.array([1]), np.array([True]), np.array([1]), np.array([ext]),
                       np.array([4] * (ext - 1) + [1 << 31]), [(3,)])
    assert (chains.h == before[0]).all() and (chains.n == before[1]).all()


def test_reset_row_restarts_from_the_empty_chain() -> None:
    """A row another request claimed: its old chain is never continued; the new request catches up from its history
    (prefix) or continues the empty chain (no prefix)."""
    chains, oracle = RowChains(3), ChainHasher()
    chains.forward(np.array([1, 2]), np.ones(2, bool), np.array([0, 0]), np.array([2, 2]), None, [(3, 4), (5, 6)])
    chains.reset([1, 2])
    assert chains.n[1:].tolist() == [0, 0] and (chains.h[1:] == np.uint64(H.CHAIN_H0)).all()
    # row 1: a new request with a 2-token cached prefix of its own history; row 2: a new request with no prefix
    got = chains.forward(np.array([1, 2]), np.ones(2, bool), np.array([2, 0]), np.array([1, 1]),
                         np.array([9, 7]), [(8, 8, 9), (7,)])
    assert got.expect_prefix[0] == H.to_i64(oracle.extend("x", [8, 8], 0))
    assert got.expect_new.tolist() == [H.to_i64(oracle.extend("x", [9], 2)), H.to_i64(oracle.extend("y", [7], 0))]


def _decoding(chains: RowChains, n: int, first: list[int]) -> np.ndarray:
    """Rows 1..n decoding, each after a one-token prefill (token ``first[i]``); returns the rows."""
    rows = np.arange(1, n + 1, dtype=np.int64)
    chains.forward(rows, np.ones(n, bool), np.zeros(n, np.int64), np.ones(n, np.int64), None, [[t] for t in first])
    return rows


def test_steady_decode_skips_padding_rows_and_counts_unknown_tokens() -> None:
    chains, oracle = _native_chains(5), ChainHasher()
    _decoding(chains, 3, [11, 12, 13])
    for k, t in zip("abc", (11, 12, 13), strict=True):
        oracle.extend(k, [t], 0)
    # a padding row (row 0, two tokens) between live rows; c's new token is unknown
    rows2, live = np.array([1, 0, 2, 3]), np.array([True, False, True, True])
    got = _steady_truth(chains, rows2, live, np.array([1, 0, 1, 1]), np.array([1, 2, 1, 1]),
                        np.array([21, 99, 99, 22, -1]))
    assert got is not None
    assert got.expect_prefix.tolist() == [H.to_i64(oracle.value("a")), 0, H.to_i64(oracle.value("b")),
                                          H.to_i64(oracle.value("c"))]
    assert got.expect_new.tolist() == [H.to_i64(oracle.extend("a", [21], 1)), 0, H.to_i64(oracle.extend("b", [22], 1)),
                                       0]
    assert got.new_known.tolist() == [True, False, True, False]
    assert chains.n[1:4].tolist() == [2, 2, 1] and chains.h[0] == np.uint64(H.CHAIN_H0)  # padding row untouched


@pytest.mark.parametrize("case", ["reset row", "rewound", "row out of range", "negative extend"])
def test_steady_decode_declines_without_changing_anything(case: str) -> None:
    chains = _native_chains(4)
    rows = _decoding(chains, 2, [5, 6])
    pre, ext, new = np.array([1, 1]), np.array([1, 1]), np.array([7, 8])
    if case == "reset row":  # another request claimed row 2
        chains.reset([2])
    elif case == "rewound":
        pre = np.array([1, 0])
    elif case == "row out of range":
        rows = np.array([1, 9])
    else:
        ext = np.array([1, -1])
    assert _steady_truth(chains, rows, np.ones(2, bool), pre, ext, new) is None


@pytest.mark.parametrize("bad", ["token", "position"])
def test_steady_decode_bad_value_writes_nothing(bad: str) -> None:
    chains = _native_chains(3)
    rows = _decoding(chains, 2, [5, 6])
    before = chains.h.copy()
    new = np.array([7, 1 << 31]) if bad == "token" else np.array([7, 8])
    if bad == "position":
        chains.n[2] = 1 << 31  # the row claims a prefix past the position limit
    pre = np.array([1, 1 << 31]) if bad == "position" else np.array([1, 1])
    assert _steady_truth(chains, rows, np.ones(2, bool), pre, np.array([1, 1]), new, declines=BAD_VALUE) is None
    assert (chains.h == before).all()


def test_reach_catches_rows_up_to_their_prefix_end() -> None:
    """RowChains.reach against the oracle: a claimed row (empty chain) and a rewound one (past its prefix: restarts)
    reach their prefix end; a row whose history stops short stops there, and reach says not every row continues."""
    rng = np.random.default_rng(5)
    hist = [[int(t) for t in rng.integers(0, 1000, 9)] for _ in range(3)]
    chains = _native_chains(4)
    chains.forward(np.array([2]), np.ones(1, bool), np.zeros(1, np.int64), np.array([7]), None, [hist[1]])
    assert int(chains.n[2]) == 7  # row 2's request had 7 tokens, then rewinds to a prefix of 3
    rows, live, pre = np.array([1, 2, 3]), np.ones(3, bool), np.array([5, 3, 4])
    assert chains.reach(rows, live, pre, [hist[0], hist[1], hist[2][:2]]) is False
    for row, tokens in ((1, hist[0][:5]), (2, hist[1][:3]), (3, hist[2][:2])):
        oracle = ChainHasher()
        assert int(chains.n[row]) == len(tokens) and int(chains.h[row]) == oracle.extend("k", tokens, 0)
    assert chains.reach(rows[:2], live[:2], pre[:2], None) is True  # nothing behind: the histories are not needed


def test_truth_segments_declines_extend_lengths_whose_sum_wraps() -> None:
    """Dead rows whose extend lengths wrap an int64 running sum back to 0 must not make a live row read the tokens at
    the wrapped offset: the native op declines the batch."""
    cpu = _native.module("cpu")
    h, n = np.zeros(ROWS, np.int64), np.zeros(ROWS, np.int64)
    ext = np.array([1 << 62] * 4 + [1], np.int64)
    live = np.array([False] * 4 + [True])
    rows, pre, out = np.arange(5, dtype=np.int64), np.zeros(5, np.int64), np.zeros((4, 5), np.int64)
    got = cpu.truth_segments(rows, pre, ext, np.array([7], np.int64), live, h, n, 0, out)
    assert got == NOT_STEADY and not n.any() and not out.any()
