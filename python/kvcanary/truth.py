"""Token truth on the host (docs/ops-contract.md 8): the incremental chain hasher behind EXPECT_PREFIX / EXPECT_NEW."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from kvcanary_schema import CHAIN_BASE, CHAIN_SEED, SPLITMIX_MUL1, SPLITMIX_MUL2, TOKEN_LIMIT

from kvcanary import _native
from kvcanary.errors import CanaryInputError
from kvcanary.ops import hashes as H
from kvcanary.ops.stage_batch import BAD_VALUE

Tokens = Sequence[int] | torch.Tensor

# From this many tokens on, a numpy fold beats a Python step per token.
_VECTOR_MIN_TOKENS = 12


def fold(h: int, tokens: Tokens, first_position: int) -> int:
    """Chain value (u64) after folding ``tokens`` at positions ``first_position, first_position + 1...`` into ``h``."""
    t = tokens.detach().to("cpu", torch.int64).reshape(-1) if isinstance(tokens, torch.Tensor) else None
    n = t.shape[0] if t is not None else len(tokens)
    if n == 0:
        return h & H.U64
    if first_position < 0 or first_position + n > TOKEN_LIMIT:
        raise CanaryInputError(f"positions [{first_position}, {first_position + n}) outside [0, {TOKEN_LIMIT})")
    if n < _VECTOR_MIN_TOKENS:
        vals = t.tolist() if t is not None else list(tokens)
        for i, tok in enumerate(vals):
            h = H.chain_step_int(h, int(tok), first_position + i)  # raises CanaryInputError on a bad token
        return h
    try:
        arr = t.numpy() if t is not None else np.asarray(tokens, dtype=np.int64).reshape(-1)
    except (OverflowError, TypeError, ValueError):
        raise CanaryInputError(f"tokens must be integers in [0, {TOKEN_LIMIT})") from None
    if arr.shape[0] != n or int(arr.min()) < 0 or int(arr.max()) >= TOKEN_LIMIT:
        raise CanaryInputError(f"tokens must lie in [0, {TOKEN_LIMIT})")
    # h_n = B^n h + sum_i g_i B^(n-1-i): one wrapping dot product (uint64 products and sums wrap mod 2^64).
    pw = _POWERS.upto(n + 1)
    tail = int((chain_g_np(arr, np.arange(first_position, first_position + n, dtype=np.int64)) * pw[n - 1::-1]).sum())
    return (h * int(pw[n]) + tail) & H.U64


class ChainHasher:
    """Per request key, the chain value of its true history so far, extended in O(new tokens).

    With ``offset`` o (a draft pool, e.g. EAGLE's o = 1), the tracked history holds at position p the true token of
    position p + o: the true tokens of positions < o are not part of it.
    """

    def __init__(self, offset: int = 0) -> None:
        """A hasher with no requests; ``offset`` >= 0 shifts the history as described above."""
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise CanaryInputError(f"offset must be an int >= 0, got {offset!r}")
        self.offset = offset
        self._state: dict[Hashable, tuple[int, int]] = {}  # key -> (h as u64, true tokens consumed)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._state

    def __len__(self) -> int:
        return len(self._state)

    def length(self, key: Hashable) -> int:
        """True tokens of ``key`` consumed so far (0 for an unknown key)."""
        return self._state.get(key, (H.CHAIN_H0, 0))[1]

    def value(self, key: Hashable) -> int:
        """Chain value (u64) of ``key``'s history; h_0 for an unknown key (empty history)."""
        return self._state.get(key, (H.CHAIN_H0, 0))[0]

    def extend(self, key: Hashable, tokens: Tokens, start_position: int) -> int:
        """Append the true tokens of positions ``start_position...`` (must equal :meth:`length`); returns the u64."""
        h, n = self._state.get(key, (H.CHAIN_H0, 0))
        if start_position != n:
            raise CanaryInputError(f"request {key!r}: extend at {start_position}, but {n} tokens are known "
                                   f"(drop() and re-extend to rewrite history)")
        count = tokens.numel() if isinstance(tokens, torch.Tensor) else len(tokens)
        skip = max(0, self.offset - start_position)  # true positions < offset have no place in the history
        if skip:
            tokens = tokens.reshape(-1)[skip:] if isinstance(tokens, torch.Tensor) else tokens[skip:]
        h = fold(h, tokens, start_position + skip - self.offset)
        self._state[key] = (h, n + count)
        return h

    def drop(self, key: Hashable) -> None:
        """Forget ``key`` (finished or retracted request); unknown keys are ignored."""
        self._state.pop(key, None)

    def values(self, keys: Sequence[Hashable], device: torch.device | str = "cpu") -> torch.Tensor:
        """int64 tensor of the keys' chain values as stored in records and plans (u64 bit-cast)."""
        return torch.tensor([H.to_i64(self.value(k)) for k in keys], dtype=torch.int64, device=device)

    def extend_batch(self, keys: Sequence[Hashable], tokens: Sequence[Tokens], start_positions: Sequence[int],
                     device: torch.device | str = "cpu") -> torch.Tensor:
        """:meth:`extend` for each request in order; int64 tensor of the new chain values (u64 bit-cast)."""
        if not len(keys) == len(tokens) == len(start_positions):
            raise CanaryInputError("keys, tokens and start_positions must have the same length")
        new = [H.to_i64(self.extend(k, t, s)) for k, t, s in zip(keys, tokens, start_positions, strict=True)]
        return torch.tensor(new, dtype=torch.int64, device=device)


def chain_truth(hasher: ChainHasher, key: Hashable, history: Sequence[int], prefix_len: int, extend_len: int,
                offset: int = 0) -> tuple[int | None, int | None]:
    """Expected chain values (int64 bit-cast) of one request's forward, from its true ``history`` (prompt + committed
    outputs), advancing ``hasher`` in O(new tokens): ``(expect_prefix, expect_new)``, each None where unknown (no
    prefix, history not yet known that far, or a prefix the hasher cannot reach). A rewound history (retract,
    rollback) is rebuilt once."""
    known = len(history)
    want_pre, want_new = prefix_len + offset, prefix_len + extend_len + offset
    n = hasher.length(key)
    if n > want_pre:
        hasher.drop(key)
        n = 0
    reach = min(known, want_pre)
    h = hasher.extend(key, history[n:reach], n) if reach > n else hasher.value(key)
    at_pre = max(n, reach) == want_pre
    ep = H.to_i64(h) if prefix_len > 0 and at_pre else None
    en = None
    if extend_len > 0 and known >= want_new and at_pre:
        en = H.to_i64(hasher.extend(key, history[want_pre:want_new], want_pre))
    return ep, en


_U64 = np.uint64


def all_set(mask: np.ndarray) -> bool:
    """``mask.all()`` for a bool array, without the ufunc reduction (several times slower on the small arrays of a
    forward's requests)."""
    return int(np.count_nonzero(mask)) == mask.size


_SEED, _MUL1, _MUL2, _BASE = (np.uint64(v) for v in (CHAIN_SEED, SPLITMIX_MUL1, SPLITMIX_MUL2, CHAIN_BASE))
_S27, _S30, _S31, _S32 = (np.uint64(v) for v in (27, 30, 31, 32))


def new_token_truth(truth: Sequence[Sequence[int]], pre: Sequence[int], ext: Sequence[int], n: int,
                    offset: int = 0) -> np.ndarray:
    """BatchView.true_new_tokens from per-row histories: the true token of each new position p of row i,
    ``truth[i][p + offset]``, flat like input_ids (rows' ``ext[i]`` tokens in order), -1 past a history's end."""
    flat: list[int] = []
    for hist, p, e in zip(truth, pre, ext, strict=True):  # one flat list, one conversion (not a copy per row)
        q = p + offset
        if e == 1 and q >= 0:  # a decoding row: its one token, no slice (a list per row costs more)
            flat.append(hist[q] if q < len(hist) else -1)
            continue
        seg = hist[q:q + e]
        flat.extend(seg)
        if len(seg) < e:
            flat.extend((-1,) * (e - len(seg)))
    if len(flat) > n:
        raise CanaryInputError(f"extend lengths sum to {len(flat)}, more than the {n} new tokens")
    out = np.full(n, -1, dtype=np.int64)
    out[:len(flat)] = flat
    return out


def chain_g_np(tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """g(t, p) on int64 numpy arrays, as uint64 (callers check the range: 0 <= t, p < TOKEN_LIMIT)."""
    x = (positions.view(_U64) << _S32) | tokens.view(_U64)
    x ^= _SEED
    x ^= x >> _S30
    x *= _MUL1
    x ^= x >> _S27
    x *= _MUL2
    x ^= x >> _S31
    return x


class _Powers:
    """CHAIN_BASE^k mod 2^64 as uint64, k = 0..n-1, grown on demand (one table for the module: it depends on nothing
    else)."""

    def __init__(self) -> None:
        self.table = np.ones(1, dtype=_U64)

    def upto(self, n: int) -> np.ndarray:
        while self.table.shape[0] < n:
            k = self.table.shape[0]
            self.table = np.concatenate([self.table, self.table * _U64(pow(CHAIN_BASE, k, 1 << 64))])
        return self.table


_POWERS = _Powers()


@dataclass
class BatchTruth:
    """Expected chain values (int64 bit-cast) of one forward's requests and which of them are known."""

    expect_prefix: np.ndarray  # int64 [bs]
    expect_new: np.ndarray  # int64 [bs]
    prefix_known: np.ndarray  # bool [bs]
    new_known: np.ndarray  # bool [bs]


class RowChains:
    """Token truth in bulk: per slot-table row, the chain value of its request's true history and the true tokens
    consumed (numpy arrays). The row state belongs to the row's current request: the caller resets a row when another
    request claims it (:class:`~kvcanary.rows.RequestRows`), to the empty chain. A forward whose requests continue
    where their rows left off is hashed with a few vectorized numpy ops (no Python step per request); other requests
    (rewound, or past a prefix the row never saw) catch up one by one through :func:`chain_truth`, which stays the
    oracle."""

    def __init__(self, rows: int, offset: int = 0, step: Callable[..., int] | None = None,
                 segments: Callable[..., int] | None = None) -> None:
        """State for ``rows`` slot-table rows; ``offset`` as in :class:`ChainHasher`; ``step``: the native
        ``hash_chain_step(h, tokens, positions, out) -> errors`` of the C++ backend (None: numpy); ``segments``: its
        ``truth_segments`` (docs/ops-contract.md 8d), which hashes the continuing requests of any forward in one call
        (None: numpy). The steady batch's one-call form is ``begin_decode`` (8c), on ``h`` and ``n``."""
        self.offset = offset
        self.step = step
        self.segments = segments
        self.h = np.full(rows, H.CHAIN_H0, dtype=_U64)
        self.n = np.zeros(rows, dtype=np.int64)

    def reset(self, rows: Sequence[int] | np.ndarray) -> None:
        """Rows now held by another request (or none): back to the empty chain."""
        self.h[rows] = H.CHAIN_H0
        self.n[rows] = 0

    def forward(self, rows: np.ndarray, live: np.ndarray, pre: np.ndarray, ext: np.ndarray,
                new_tokens: np.ndarray | None, histories: Sequence[Sequence[int]] | None) -> BatchTruth:
        """Expected chains of one forward and the state advanced past its new tokens.

        ``rows``/``pre``/``ext`` int64 [bs], ``live`` bool [bs] (False: padding, untouched); ``new_tokens`` int64
        [num_tokens], flat like input_ids: the true token of each new position p (the history's token at p + offset),
        negative where unknown; ``histories`` the true histories (for catch-up).
        """
        bs = rows.shape[0]
        fast = live & (self.n[rows] == pre + self.offset)
        if new_tokens is not None and all_set(fast) and all_set(ext == 1):
            return self._decode(rows, pre, new_tokens[:bs])
        out = self._native_fast(rows, fast, pre, ext, new_tokens) if new_tokens is not None else None
        if out is None:
            out = BatchTruth(np.zeros(bs, np.int64), np.zeros(bs, np.int64), np.zeros(bs, bool), np.zeros(bs, bool))
            if new_tokens is not None:
                self._fast(np.flatnonzero(fast), rows, pre, ext, new_tokens, out)
            else:
                fast[:] = False
        for i in np.flatnonzero(live & ~fast).tolist():
            self._catch_up(i, int(rows[i]), int(pre[i]), int(ext[i]), None if histories is None else histories[i],
                           out)
        return out

    def _decode(self, rows: np.ndarray, pre: np.ndarray, tok: np.ndarray) -> BatchTruth:
        """The common decode forward: every request continues with one new token (no index gathers)."""
        h = self.h[rows]
        h_end, known = self._fold_one(h, tok, pre)
        has_prefix = pre > 0
        # the usual case (every token known, every request past its first token) needs no selects
        every = all_set(known)
        self.h[rows] = h_end if every else np.where(known, h_end, h)
        self.n[rows] = pre + (self.offset + 1) if every else pre + self.offset + known
        return BatchTruth(h.view(np.int64) if all_set(has_prefix) else np.where(has_prefix, h.view(np.int64), 0),
                          h_end.view(np.int64) if every else np.where(known, h_end.view(np.int64), 0), has_prefix,
                          known)

    def _native_fast(self, rows: np.ndarray, fast: np.ndarray, pre: np.ndarray, ext: np.ndarray,
                     new_tokens: np.ndarray) -> BatchTruth | None:
        """:meth:`_fast` of the ``fast`` rows in one native call (``truth_segments``); None where there is none or it
        declines (a row or token index out of bounds: the numpy path reports those)."""
        if self.segments is None:
            return None
        res = np.empty((4, rows.shape[0]), np.int64)
        got = self.segments(rows, pre, ext, np.ascontiguousarray(new_tokens), fast, self.h.view(np.int64), self.n,
                            self.offset, res)
        if got == BAD_VALUE:  # a known token or its position outside [0, TOKEN_LIMIT)
            raise CanaryInputError(f"true tokens / positions must lie in [0, {TOKEN_LIMIT})")
        if got < 0:
            return None
        return BatchTruth(res[0], res[1], res[2].astype(bool), res[3].astype(bool))

    def _fast(self, idx: np.ndarray, rows: np.ndarray, pre: np.ndarray, ext: np.ndarray, new_tokens: np.ndarray,
              out: BatchTruth) -> None:
        """Requests continuing at their prefix end: one segmented fold over their new tokens."""
        if idx.size == 0:
            return
        r, p, e = rows[idx], pre[idx], ext[idx]
        h = self.h[r]
        out.expect_prefix[idx] = np.where(p > 0, h.view(np.int64), 0)  # no prefix: nothing to expect
        out.prefix_known[idx] = p > 0
        begin = (np.cumsum(ext) - ext)[idx]
        if (e == 1).all():  # decode: one new token each
            h_end, known = self._fold_one(h, new_tokens[begin], p)
        else:
            h_end, known = self._fold_segments(h, begin, p, e, new_tokens)
        k = idx[known]
        out.expect_new[k] = h_end[known].view(np.int64)
        out.new_known[k] = True
        self.h[r[known]] = h_end[known]
        self.n[r[known]] = (p + e + self.offset)[known]

    def _fold_one(self, h: np.ndarray, tok: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(h * B + g(t, p), known) for one token per request (one native call when the C++ backend is loaded)."""
        known = tok >= 0
        if self.step is None:
            self._check(tok, pos)
            return h * _BASE + chain_g_np(np.maximum(tok, 0), pos), known
        out = np.empty_like(h)
        errors = self.step(h.view(np.int64), np.ascontiguousarray(tok), np.ascontiguousarray(pos), out.view(np.int64))
        if errors > tok.size - int(np.count_nonzero(known)):  # more than the unknown tokens: a value out of range
            raise CanaryInputError(f"true tokens / positions must lie in [0, {TOKEN_LIMIT})")
        return out, known

    def _fold_segments(self, h: np.ndarray, begin: np.ndarray, pre: np.ndarray, ext: np.ndarray,
                       new_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(h * B^e + sum_j g_j B^(e-1-j), known) over each request's e new tokens (h_n of the chain)."""
        seg = np.repeat(np.arange(ext.size), ext)
        start = np.cumsum(ext) - ext  # each request's first token in the flat arrays below
        j = np.arange(seg.size) - start[seg]
        tok = new_tokens[begin[seg] + j]
        pos = pre[seg] + j
        self._check(tok, pos)
        pw = _POWERS.upto(int(ext.max(initial=0)) + 1)
        terms = chain_g_np(np.maximum(tok, 0), pos) * pw[ext[seg] - 1 - j]
        # per request sums over its run of the flat arrays (reduceat: runs start at strictly increasing offsets, so
        # requests without new tokens are left out; uint64 adds wrap as the chain's do)
        some = ext > 0
        sums, unknown = np.zeros(ext.size, _U64), np.zeros(ext.size, bool)
        if seg.size:
            sums[some] = np.add.reduceat(terms, start[some])
            unknown[some] = np.logical_or.reduceat(tok < 0, start[some])
        return h * pw[ext] + sums, some & ~unknown

    def _check(self, tok: np.ndarray, pos: np.ndarray) -> None:
        if tok.size and (int(tok.max()) >= TOKEN_LIMIT or int(pos.max()) >= TOKEN_LIMIT):
            raise CanaryInputError(f"true tokens / positions must lie in [0, {TOKEN_LIMIT})")

    def reach(self, rows: np.ndarray, live: np.ndarray, pre: np.ndarray,
              histories: Sequence[Sequence[int]] | None) -> bool:
        """The live rows behind their prefix end (a new request with a reused prefix, a rewound one) advanced along
        their true histories to it, one by one through :func:`chain_truth` (a row past it restarts from the empty
        chain, one whose history is shorter stops at its end); True when every live row then continues its chain."""
        want = pre + self.offset
        behind = np.flatnonzero(live & (self.n[rows] != want))
        if behind.size == 0:
            return True
        if histories is None:
            return False
        for i in behind.tolist():
            self._chain_truth(int(rows[i]), int(pre[i]), 0, histories[i])
        return all_set(self.n[rows[live]] == want[live])

    def _catch_up(self, i: int, row: int, pre: int, ext: int, history: Sequence[int] | None, out: BatchTruth) -> None:
        """One request through chain_truth, seeded with its row's state."""
        if history is None:
            return
        ep, en = self._chain_truth(row, pre, ext, history)
        out.expect_prefix[i], out.prefix_known[i] = ep or 0, ep is not None
        out.expect_new[i], out.new_known[i] = en or 0, en is not None

    def _chain_truth(self, row: int, pre: int, ext: int, history: Sequence[int]) -> tuple[int | None, int | None]:
        """:func:`chain_truth` of one request from its row's state, which it advances."""
        scratch = ChainHasher(self.offset)
        scratch._state[row] = (int(self.h[row]), int(self.n[row]))
        got = chain_truth(scratch, row, history, pre, ext, self.offset)
        self.h[row], self.n[row] = scratch.value(row), scratch.length(row)
        return got


Hashers = tuple[Callable[..., int] | None, Callable[..., int] | None]  # (hash_chain_step, truth_segments)


def host_hashers(backend: str) -> Hashers:
    """The C++ module's host ops that serve the bulk token truth (``hash_chain_step``, ``truth_segments``) when a
    native backend is in use and the CPU module loads; (None, None): numpy."""
    if backend == "torch" or not _native.available("cpu"):
        return None, None
    mod = _native.module("cpu")
    return mod.hash_chain_step, mod.truth_segments


class KeyedChains:
    """:class:`RowChains` for requests known by key only (an engine's scheduler: no slot-table rows). A key takes a
    row on its first forward and gives it back on :meth:`drop`; the arrays grow as needed. A forward's requests are
    hashed in bulk (``chain_truth`` per request stays the oracle)."""

    def __init__(self, offset: int = 0, step: Callable[..., int] | None = None,
                 segments: Callable[..., int] | None = None, rows: int = 64) -> None:
        """State for ``rows`` keys at first; ``offset``, ``step``, ``segments`` as in :class:`RowChains`."""
        self.chains = RowChains(rows, offset, step, segments)
        self._row: dict[Hashable, int] = {}
        self._free = list(range(rows - 1, -1, -1))

    def __contains__(self, key: Hashable) -> bool:
        return key in self._row

    def drop(self, key: Hashable) -> None:
        """Forget ``key`` (finished, preempted or retracted request); unknown keys are ignored."""
        row = self._row.pop(key, None)
        if row is not None:
            self._free.append(row)

    def forward(self, keys: Sequence[Hashable], pre: np.ndarray, ext: np.ndarray,
                histories: Sequence[Sequence[int]]) -> BatchTruth:
        """Expected chains of one forward of distinct ``keys`` (``pre``/``ext`` int64 [bs]) from their true
        ``histories``; each key's state advanced past its new tokens."""
        rows = np.fromiter((self._row_of(k) for k in keys), dtype=np.int64, count=len(keys))
        new = new_token_truth(histories, pre.tolist(), ext.tolist(), int(np.maximum(ext, 0).sum()),
                              self.chains.offset)
        return self.chains.forward(rows, np.ones(rows.shape[0], dtype=bool), pre, ext, new, histories)

    def _row_of(self, key: Hashable) -> int:
        row = self._row.get(key)
        if row is None:
            if not self._free:
                self._grow()
            row = self._row[key] = self._free.pop()
            self.chains.reset([row])
        return row

    def _grow(self) -> None:
        c, n = self.chains, self.chains.n.shape[0]
        c.h = np.concatenate([c.h, np.full(n, H.CHAIN_H0, dtype=_U64)])
        c.n = np.concatenate([c.n, np.zeros(n, dtype=np.int64)])
        self._free = list(range(2 * n - 1, n - 1, -1))
