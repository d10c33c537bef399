"""Token truth in bulk: RowChains (numpy, per slot-table row) against ChainHasher + chain_truth as the oracle."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcanary import _native
from kvcanary.errors import CanaryInputError
from kvcanary.ops import hashes as H
from kvcanary.truth import ChainHasher, RowChains, chain_g_np, chain_truth

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


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(_forward, min_size=1, max_size=8), offset=st.integers(0, 1), seed=st.integers(0, 2**16),
       bulk=st.booleans(), native=st.booleans())
def test_row_chains_equal_chain_hasher(steps: list[list[tuple[int, int, int, bool]]], offset: int, seed: int,
                                       bulk: bool, native: bool) -> None:
    rng = np.random.default_rng(seed)
    hist = {k: [int(t) for t in rng.integers(0, 1000, int(rng.integers(4, 30)))] for k in range(5)}  # truth known
    done = dict.fromkeys(range(5), 0)  # tokens each request has in its KV so far
    oracle = ChainHasher(offset)
    chains = RowChains(ROWS, offset, _native.module("cpu").hash_chain_step if native else None)
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
        got = chains.forward(rows, np.array(keys, dtype=object), np.ones(len(keys), bool), pre, ext,
                             np.array(new, np.int64) if bulk else None, histories)
        for i, k in enumerate(keys):
            ep, en = chain_truth(oracle, k, hist[k], int(pre[i]), int(ext[i]), offset)
            assert (bool(got.prefix_known[i]), int(got.expect_prefix[i]) if got.prefix_known[i] else None) == \
                (ep is not None, ep), (i, k)
            assert (bool(got.new_known[i]), int(got.expect_new[i]) if got.new_known[i] else None) == \
                (en is not None, en), (i, k)
            done[k] = int(pre[i] + ext[i])


def test_padding_rows_are_left_alone() -> None:
    chains = RowChains(4)
    got = chains.forward(np.array([0, 1]), np.array([None, "a"], dtype=object), np.array([False, True]),
                         np.array([0, 0]), np.array([2, 2]), np.array([5, 6, 7, 8]), [(), (7, 8)])
    assert not got.prefix_known.any() and got.new_known.tolist() == [False, True]
    assert chains.owner[0] is None and chains.owner[1] == "a"


@pytest.mark.parametrize("native", [False, True])
def test_bad_true_token_raises(native: bool) -> None:
    chains = RowChains(2, step=_native.module("cpu").hash_chain_step if native else None)
    chains.forward(np.array([1]), np.array(["a"], dtype=object), np.array([True]), np.array([0]), np.array([1]),
                   None, [(3,)])
    with pytest.raises(CanaryInputError):
        chains.forward(np.array([1]), np.array(["a"], dtype=object), np.array([True]), np.array([1]),
                       np.array([1]), np.array([1 << 31]), [(3,)])


def test_drop_forgets_the_row() -> None:
    chains = RowChains(2)
    chains.forward(np.array([1]), np.array(["a"], dtype=object), np.array([True]), np.array([0]), np.array([1]),
                   None, [(3,)])
    chains.drop("a")
    assert chains.owner[1] is None
    chains.drop("missing")
