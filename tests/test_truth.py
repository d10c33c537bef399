"""ChainHasher: values against Python-int chains, incremental = one-shot, draft offset, torch path, bad input;
KeyedChains against chain_truth."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcanary.errors import CanaryInputError
from kvcanary.ops import hashes as H
from kvcanary.truth import ChainHasher, KeyedChains, chain_truth, fold, new_token_truth
from kvcanary_schema import CHAIN_ANCHOR, CHAIN_BASE, TOKEN_LIMIT


def chain_value(tokens: list[int], first_pos: int = 0) -> int:
    """h after the tokens, spelled out from DESIGN 4 with Python ints."""
    h = H.splitmix64_int(CHAIN_ANCHOR)
    for i, t in enumerate(tokens):
        h = (h * CHAIN_BASE + H.chain_g_int(t, first_pos + i)) % (1 << 64)
    return h


def test_empty_and_unknown_keys_have_h0() -> None:
    ch = ChainHasher()
    assert ch.value("x") == H.CHAIN_H0 and ch.length("x") == 0 and "x" not in ch
    assert ch.extend("x", [], 0) == H.CHAIN_H0
    assert "x" in ch and len(ch) == 1


@pytest.mark.parametrize("n", [1, 5, 11, 12, 13, 64, 300])
def test_extend_matches_python_ints(n: int) -> None:
    toks = [(i * 7919 + 13) % 150_000 for i in range(n)]
    ch = ChainHasher()
    assert ch.extend("a", toks, 0) == chain_value(toks)
    assert ch.extend("b", torch.tensor(toks), 0) == chain_value(toks)
    assert ch.length("a") == n


@settings(max_examples=40, deadline=None)
@given(toks=st.lists(st.integers(0, TOKEN_LIMIT - 1), max_size=200), cuts=st.lists(st.integers(0, 200), max_size=5))
def test_incremental_equals_one_shot(toks: list[int], cuts: list[int]) -> None:
    ch = ChainHasher()
    bounds = sorted({0, len(toks), *(c for c in cuts if c <= len(toks))})
    for a, b in zip(bounds, bounds[1:], strict=False):
        ch.extend(1, toks[a:b], a)
    assert ch.value(1) == chain_value(toks)


@settings(max_examples=30, deadline=None)
@given(h=st.integers(0, (1 << 64) - 1), toks=st.lists(st.integers(0, TOKEN_LIMIT - 1), min_size=1, max_size=300),
       first=st.integers(0, 10_000))
def test_vector_fold_equals_int_fold(h: int, toks: list[int], first: int) -> None:
    """fold (a Python step per token below 12 tokens, a numpy dot product from there) against the steps, lists and
    tensors."""
    want = h
    for i, t in enumerate(toks):
        want = H.chain_step_int(want, t, first + i)
    assert fold(h, toks, first) == want
    assert fold(h, torch.tensor(toks), first) == want


def test_draft_offset_history() -> None:
    truth = [50, 51, 52, 53, 54, 55, 56]
    draft = ChainHasher(offset=1)
    draft.extend("r", truth[:1], 0)  # position 0's true token has no place in the draft history
    assert draft.value("r") == H.CHAIN_H0
    draft.extend("r", truth[1:5], 1)
    draft.extend("r", truth[5:], 5)
    # The draft history holds at position p the true token of p + 1.
    assert draft.value("r") == chain_value(truth[1:])
    assert draft.length("r") == len(truth)
    d2 = ChainHasher(offset=2)
    assert d2.extend("r", truth, 0) == chain_value(truth[2:])


def test_batch_helpers_return_stored_int64() -> None:
    ch = ChainHasher()
    got = ch.extend_batch(["a", "b"], [[1, 2, 3], torch.tensor([4, 5])], [0, 0])
    assert got.dtype == torch.int64
    assert got.tolist() == [H.to_i64(chain_value([1, 2, 3])), H.to_i64(chain_value([4, 5]))]
    assert ch.values(["b", "a", "zz"]).tolist() == [H.to_i64(chain_value([4, 5])), H.to_i64(chain_value([1, 2, 3])),
                                                    H.to_i64(H.CHAIN_H0)]
    ch.drop("a")
    ch.drop("never")
    assert "a" not in ch and ch.length("a") == 0


def test_bad_input() -> None:
    ch = ChainHasher()
    ch.extend("a", [1, 2], 0)
    with pytest.raises(CanaryInputError, match="extend at 3"):
        ch.extend("a", [3], 3)
    with pytest.raises(CanaryInputError):
        ch.extend("b", [1, -1], 0)
    with pytest.raises(CanaryInputError):
        ch.extend("c", [TOKEN_LIMIT] * 100, 0)
    for bad in ([5] * 20 + [-1], [5] * 20 + [1 << 70], [5] * 20 + ["x"]):  # the vector path's checks
        with pytest.raises(CanaryInputError):
            ch.extend("d", bad, 0)
    with pytest.raises(CanaryInputError):
        fold(0, [1], TOKEN_LIMIT)
    with pytest.raises(CanaryInputError, match="offset"):
        ChainHasher(offset=-1)
    with pytest.raises(CanaryInputError, match="same length"):
        ch.extend_batch(["x"], [[1], [2]], [0])
    assert "b" not in ch and "c" not in ch and "d" not in ch


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(-2, 8), st.integers(0, 3)), max_size=6), st.integers(0, 2))
def test_new_token_truth_against_a_slice_per_row(rows: list[tuple[int, int, int]], offset: int) -> None:
    """The contract as one slice per row (decoding rows take a faster path): hist[p + offset : p + offset + e], padded
    with -1 to e."""
    hist = [[100 * i + k for k in range(n)] for i, (n, _, _) in enumerate(rows)]
    pre, ext = [p for _, p, _ in rows], [e for _, _, e in rows]
    want: list[int] = []
    for h, p, e in zip(hist, pre, ext, strict=True):
        seg = h[p + offset:p + offset + e]
        want += seg + [-1] * (e - len(seg))
    assert new_token_truth(hist, pre, ext, len(want) + 1, offset).tolist() == [*want, -1]


def test_new_token_truth_is_flat_like_input_ids_with_the_offset() -> None:
    """Hand-computed: row 0 continues at 2 with 2 tokens, row 1 (offset 1) runs past its history, row 2 is padding."""
    hist = [(10, 11, 12, 13), (20, 21, 22), ()]
    assert new_token_truth(hist, [2, 1, 0], [2, 3, 1], 6).tolist() == [12, 13, 21, 22, -1, -1]
    assert new_token_truth(hist, [2, 1, 0], [2, 3, 1], 6, offset=1).tolist() == [13, -1, 22, -1, -1, -1]
    with pytest.raises(CanaryInputError, match="more than the 5 new tokens"):
        new_token_truth(hist, [2, 1, 0], [2, 3, 1], 5)


def _keyed_forwards(seed: int, offset: int, native: bool) -> None:
    """Random forwards of a few requests (new ones, continuing, rewound, dropped, histories shorter than the forward)
    through KeyedChains (starting with 2 rows, so it grows), against chain_truth on one ChainHasher per request."""
    from kvcanary import _native  # noqa: PLC0415

    rng = random.Random(seed)
    mod = _native.module("cpu") if native else None
    keyed = KeyedChains(offset, None if mod is None else mod.hash_chain_step,
                        None if mod is None else mod.truth_segments, rows=2)
    oracle = ChainHasher(offset)
    hist = {k: [rng.randrange(50) for _ in range(rng.randint(1, 40))] for k in range(9)}
    done = dict.fromkeys(hist, 0)
    for _ in range(30):
        keys = rng.sample(sorted(hist), rng.randint(1, 6))
        pre, ext = [], []
        for k in keys:
            if rng.random() < 0.15:  # a rewind (retraction) or a jump (prefix-cache hit)
                done[k] = rng.randint(0, len(hist[k]))
            e = rng.choice([1, 1, 1, rng.randint(0, 9)])
            pre.append(done[k])
            ext.append(e)
            done[k] += e
            hist[k] += [rng.randrange(50) for _ in range(rng.randint(0, 2))]
        got = keyed.forward(keys, np.array(pre, np.int64), np.array(ext, np.int64), [hist[k] for k in keys])
        for i, k in enumerate(keys):
            ep, en = chain_truth(oracle, k, hist[k], pre[i], ext[i], offset)
            assert (bool(got.prefix_known[i]), bool(got.new_known[i])) == (ep is not None, en is not None), (seed, k)
            assert int(got.expect_prefix[i]) == (ep or 0) and int(got.expect_new[i]) == (en or 0), (seed, k)
        for k in rng.sample(sorted(hist), rng.randint(0, 2)):  # finished or preempted: both forget it
            keyed.drop(k)
            oracle.drop(k)
            done[k] = 0


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("offset", [0, 1])
def test_keyed_chains_equal_chain_truth(native: bool, offset: int) -> None:
    for seed in range(40):
        _keyed_forwards(seed, offset, native)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32))
def test_keyed_chains_property(seed: int) -> None:
    _keyed_forwards(seed, seed % 2, True)
