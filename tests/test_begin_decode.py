"""begin_decode (docs/ops-contract.md 8c): the torch reference against the C++ CPU op, hand vectors, declines, bad
input."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcanary.errors import CanaryInputError
from kvcanary.ops import hashes as H
from kvcanary.ops.stage_batch import BAD_VALUE, NOT_STEADY, STAGING_ROWS, begin_decode
from kvcanary.truth import RowChains
from kvcanary_schema import TOKEN_LIMIT, PlanFlag

BACKENDS = ["torch", "cpu"]
NO_NEW = ~int(PlanFlag.EXPECT_NEW)
STEP = 42


class Case:
    """One call's arguments; every buffer filled with a marker so that writes show."""

    def __init__(self, rows: list[int], pre: list[int], ext: list[int], new: list[int], live: list[bool],
                 h: list[int], n: list[int], offset: int = 0, nt: int | None = None,
                 reuse: list[int] | None = None) -> None:
        bs, nt = len(rows), sum(max(e, 0) for e in ext) if nt is None else nt
        self.src = [torch.tensor(v, dtype=torch.int64) for v in (rows, pre, ext)] + \
            [torch.arange(nt, dtype=torch.int64) + 100 * k for k in range(1, 4)]
        self.staging = torch.full((STAGING_ROWS, bs + 2), 7, dtype=torch.int64)
        self.dst = tuple(torch.full(shape, 9, dtype=torch.int64)
                         for shape in ((3, bs + 2), (STAGING_ROWS, bs + 2), (3, nt + 1)))
        self.host = tuple(np.array(v, np.int64) for v in (rows, pre, ext))
        self.new, self.live = np.array(new, np.int64), np.array(live, bool)
        self.h, self.n, self.offset, self.pads = np.array(h, np.uint64).view(np.int64), np.array(n, np.int64), offset, \
            (bs + 1, nt + 1)
        self.seen, self.prefix = np.full(len(h), -5, np.int64), np.full(len(h), -6, np.int64)
        self.reuse = None if reuse is None else np.array(reuse, np.int64)
        self.event = 0

    def run(self, backend: str) -> int:
        return begin_decode(self.src, self.staging, *self.dst, *self.pads, 0, self.host, self.new, self.live, self.h,
                            self.n, self.offset, self.seen, self.prefix, STEP, backend=backend, reuse=self.reuse,
                            event=self.event)

    def state(self) -> list[list[int]]:
        return [t.tolist() for t in (self.staging, *self.dst)] + \
            [a.tolist() for a in (self.h, self.n, self.seen, self.prefix)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_vector(backend: str) -> None:
    h0 = H.chain_step_int(H.CHAIN_H0, 5, 0)  # row 2 after one token
    c = Case(rows=[2, 0, 1], pre=[1, 0, 0], ext=[1, 0, 1], new=[6, -1], live=[True, False, True],
             h=[H.CHAIN_H0, H.CHAIN_H0, h0], n=[0, 0, 1])
    assert c.run(backend) == 1  # row 1's token is unknown
    want_new = H.chain_step_int(h0, 6, 1)
    assert c.staging[:, :3].tolist() == [[H.to_i64(h0), 0, 0], [H.to_i64(want_new), 0, 0], [-1, -1, NO_NEW],
                                         [0, 0, 0], [0, 0, 0]]
    assert c.h.view(np.uint64)[2] == want_new and c.n.tolist() == [0, 0, 2]  # row 1 (unknown token) stays
    assert c.seen.tolist() == [-5, STEP, STEP] and c.prefix.tolist() == [-6, 0, 1]  # the live rows ran
    rows, truth, tokens = (d.tolist() for d in c.dst)
    assert rows == [[2, 0, 1, 0, 9], [1, 0, 0, 0, 9], [1, 0, 1, 0, 9]]  # row 3: the padding row
    assert truth[1][:3] == c.staging[1, :3].tolist() and truth[0][3:] == [9, 9]
    assert tokens == [[100, 101, 9], [200, 201, 9], [300, 301, -1]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_vector_segments_and_reuse_ends(backend: str) -> None:
    """Rows of several new tokens (a prefill chunk, a speculative round), a live row of none, one with an unknown
    token among known ones, and the reuse ends of new requests."""
    h1 = H.chain_step_int(H.CHAIN_H0, 5, 0)  # row 1 after one token
    c = Case(rows=[0, 1, 2, 3], pre=[0, 1, 2, 0], ext=[3, 2, 0, 2], new=[7, 8, 9, 4, 3, 11, -1],
             live=[True, True, True, True], h=[H.CHAIN_H0, h1, 77, H.CHAIN_H0], n=[0, 1, 2, 0],
             reuse=[0, 1, 0, 0])
    assert c.run(backend) == 2  # row 2 brings no token, row 3 an unknown one
    want0 = H.chain_step_int(H.chain_step_int(H.chain_step_int(H.CHAIN_H0, 7, 0), 8, 1), 9, 2)
    want1 = H.chain_step_int(H.chain_step_int(h1, 4, 1), 3, 2)
    assert c.staging[:, :4].tolist() == [[0, H.to_i64(h1), 77, 0], [H.to_i64(want0), H.to_i64(want1), 0, 0],
                                         [-1, -1, NO_NEW, NO_NEW], [0, 0, 0, 0], [0, 1, 0, 0]]
    assert c.h.view(np.uint64)[:2].tolist() == [want0, want1] and c.n.tolist() == [3, 3, 2, 0]
    assert c.seen.tolist() == [STEP] * 4 and c.prefix.tolist() == [0, 1, 2, 0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["rewound", "row out of range", "negative extend"])
def test_declines_write_nothing(backend: str, case: str) -> None:
    kw = dict(rows=[1, 2], pre=[3, 3], ext=[1, 1], new=[5, 6], live=[True, True], h=[1, 2, 3], n=[0, 3, 3])
    if case == "rewound":
        kw.update(pre=[3, 2])
    elif case == "row out of range":
        kw.update(rows=[1, 3])
    else:
        kw.update(ext=[1, -1], new=[5])
    c = Case(**kw)  # type: ignore[arg-type]
    before = c.state()
    assert c.run(backend) == NOT_STEADY and c.state() == before


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", ["token", "position"])
def test_bad_values_write_nothing(backend: str, bad: str) -> None:
    pre = [3, TOKEN_LIMIT] if bad == "position" else [3, 3]
    c = Case(rows=[1, 2], pre=pre, ext=[1, 1], new=[5, TOKEN_LIMIT if bad == "token" else 6], live=[True, True],
             h=[1, 2, 3], n=[0, 3, pre[1]])
    before = c.state()
    assert c.run(backend) == BAD_VALUE and c.state() == before


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", ["extend sum", "extend sum wraps", "host length", "true_new length", "live length",
                                 "staging rows", "row state length", "reuse length", "an event off CUDA"])
def test_input_errors_raise_before_any_write(backend: str, bad: str) -> None:
    c = Case(rows=[1, 2], pre=[3, 3], ext=[1, 1], new=[5, 6], live=[True, True], h=[1, 2, 3], n=[0, 3, 3])
    if bad == "extend sum":
        c.host = (c.host[0], c.host[1], np.array([2, 1], np.int64))
    elif bad == "extend sum wraps":  # 2^62 + 2^62 wraps an int64 sum to a negative one
        c.host = (c.host[0], c.host[1], np.array([1 << 62, 1 << 62], np.int64))
    elif bad == "host length":
        c.host = (c.host[0][:1], c.host[1], c.host[2])
    elif bad == "true_new length":
        c.new = c.new[:1]
    elif bad == "live length":
        c.live = c.live[:1]
    elif bad == "staging rows":
        c.staging = c.staging[:4]
    elif bad == "reuse length":
        c.reuse = np.zeros(3, np.int64)
    elif bad == "an event off CUDA":  # only the CUDA op's pinned staging has an event
        c.event = 1
    else:
        c.seen = c.seen[:2]
    before = c.state()
    with pytest.raises(CanaryInputError):
        c.run(backend)
    assert c.state() == before


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**31), offset=st.integers(0, 2))
def test_torch_and_cpu_agree_and_match_the_numpy_truth(seed: int, offset: int) -> None:
    """Random batches, mostly steady: both backends write the same bits; a steady one's expected chains are those of
    RowChains.forward (the vectorized numpy path) on the same state."""
    rng = random.Random(seed)
    rows_n, bs = rng.randint(2, 8), rng.randint(0, 6)
    n = [rng.randint(0, 50) for _ in range(rows_n)]
    h = [rng.getrandbits(64) for _ in range(rows_n)]
    rows = [rng.randrange(rows_n + (rng.random() < 0.05)) for _ in range(bs)]
    live = [rng.random() < 0.85 for _ in range(bs)]
    pre = [n[r] - offset if r < rows_n and rng.random() < 0.93 else rng.randint(0, 50) for r in rows]
    ext = [1 if rng.random() < 0.6 else rng.randint(0, 4) for _ in live]
    new = [-1 if rng.random() < 0.05 else rng.randrange(TOKEN_LIMIT) for _ in range(sum(ext))]
    reuse = [rng.randint(0, 60) for _ in range(bs)] if rng.random() < 0.5 else None
    out = []
    for backend in BACKENDS:
        c = Case(rows, pre, ext, new, live, h, n, offset, reuse=reuse)
        out.append((c.run(backend), c.state()))
    assert out[0] == out[1]
    got, state = out[0]
    if got < 0:
        return
    chains = RowChains(rows_n, offset)
    chains.h[:], chains.n[:] = np.array(h, np.uint64), n
    idx = np.flatnonzero(np.array(live, bool))
    r, p, e = (np.array(v, np.int64)[idx] for v in (rows, pre, ext))
    starts = np.cumsum([0, *ext])
    mine = [new[starts[i]:starts[i + 1]] for i in idx.tolist()]  # the live rows' tokens, flat like input_ids
    truth = chains.forward(r, np.ones(idx.size, bool), p, e, np.array([t for m in mine for t in m], np.int64), None)
    staging = np.array(state[0])
    assert staging[1, idx].tolist() == np.where(truth.new_known, truth.expect_new, 0).tolist()
    assert staging[0, idx].tolist() == np.where(p > 0, truth.expect_prefix, 0).tolist()
    assert got == int(np.count_nonzero(~truth.new_known))
    assert staging[4, :bs].tolist() == (reuse or [0] * bs)
