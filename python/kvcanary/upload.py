"""The host half of begin_forward: batch facts and token truth into the static device buffers, in bulk."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

import numpy as np
import torch
from kvcanary_schema import STAGE_INLINE_ROWS, TOKEN_LIMIT, PlanFlag, TokenTruth

from kvcanary.adapter import BatchView, PoolDescription, extends_fit
from kvcanary.config import CanaryConfig, CoveragePolicy
from kvcanary.errors import CanaryInputError, KVCanaryInternalError
from kvcanary.health import Health
from kvcanary.ops.scatter_tokens import scatter_tokens
from kvcanary.ops.stage_batch import BAD_VALUE, BatchStager
from kvcanary.rows import RequestRows
from kvcanary.state import CanaryState
from kvcanary.streams import CurrentStream
from kvcanary.stripes import Stripes
from kvcanary.truth import BatchTruth, RowChains, all_set, host_hashers

KEEP_ALL = -1  # flag mask keeping every PlanFlag bit
NO_PREFIX = ~int(PlanFlag.EXPECT_PREFIX)
NO_NEW = ~int(PlanFlag.EXPECT_NEW)
HeldIds = list[Hashable | None]  # a batch's request ids as their rows hold them (a list nothing changes after)


class Held(NamedTuple):
    """A batch whose every request holds its row (:meth:`Upload._held`): its ids as held, its live mask, and its rows
    and live mask as ``begin_decode`` takes them (converted once per held batch: the two conversions cost the native
    call about 0.7 µs on the CPU box, ``gpu/probe_ffi_args.py``)."""

    ids: HeldIds
    live: np.ndarray
    rows_arg: object
    live_arg: object


def host_i64(values: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    """A contiguous host int64 numpy array of batch facts given as a list, an array or a CPU tensor (no copy when
    possible)."""
    if isinstance(values, torch.Tensor):
        if values.dtype == torch.int64 and values.is_cpu:  # viewed as is: an integer tensor never requires grad
            return np.ascontiguousarray(values.numpy())
        return values.detach().to("cpu", torch.int64).numpy()
    return np.ascontiguousarray(values, dtype=np.int64)


def host_array(values: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
    """A contiguous host int64 array or tensor, as given when it already is one (native ops take either)."""
    if isinstance(values, torch.Tensor) and values.dtype == torch.int64 and values.is_cpu and values.is_contiguous():
        return values
    return host_i64(values)


def request_keys(ids: Sequence[Hashable | None]) -> np.ndarray:
    """The request ids as a 1-D object array (tuple ids stay whole)."""
    return np.fromiter(ids, dtype=object, count=len(ids))


class Upload:
    """Per forward: the batch copied into the static buffers, and per request the expected chains, EXPECT_* flag
    mask, stripe end and reuse end staged in pinned host rows and copied to the device in one copy."""

    def __init__(self, state: CanaryState, pool: PoolDescription, config: CanaryConfig, health: Health,
                 backend: str) -> None:
        """Staging for ``state``; ``health.coverage`` observes every request's verified slots."""
        self.state, self.pool, self.config, self.backend = state, pool, config, backend
        self.health = health
        self._hashers = host_hashers(backend)
        self._stage = BatchStager(state.upload, state.batch_rows, state.truth_rows, state.batch_tokens,
                                  pool.padding_row, backend)
        self.requests = RequestRows(pool.req_rows)
        self._set_chains(pool.token_offset)
        self.stripes = Stripes(config.stripe_size, config.window_links) \
            if config.coverage == CoveragePolicy.WINDOW else None
        if self.stripes is None:  # FULL policy: every running request's prefix is verified whole
            health.coverage.rows = self.requests
        self.pool_done = np.zeros(pool.req_rows, dtype=np.int64)  # POOL truth: per row, true tokens uploaded
        self._host = [u.numpy() for u in state.upload]  # the staging rows, filled on the host and staged
        self._index = 0  # the staging row the next begin() fills
        # CUDA: per staging row, the event after the last stage_batch that read it (reused: a new event per forward
        # costs more host time than the launch; synchronizing one never recorded returns at once)
        self._copied = [torch.cuda.Event() for _ in range(2)] if state.device.type == "cuda" else []  # type: ignore[no-untyped-call]
        self._stream = CurrentStream(state.device.index or 0) if state.device.type == "cuda" else None
        # the native CUDA begin_decode awaits and records a staging row's event itself (two CUDA calls, where torch's
        # Event.synchronize and .record cost microseconds of Python each): the events' handles, created by a first
        # record on the current stream
        self._handles = [0, 0]
        if self._stream is not None and self._stage.backend == "cuda":
            for e in self._copied:
                e.record(self._stream.get())
            self._handles = [int(e.cuda_event) for e in self._copied]
        # (rows, tokens) of the static batch buffers that may hold a batch's values; everything past them is padding
        # (CanaryState allocates them so)
        self._dirty = (0, 0)
        self.any_new = True
        # the last held batch (:meth:`_held`): (requests.version, its rows' bytes, its answer)
        self._last_held: tuple[int, bytes, Held] | None = None
        # begin_decode serves the batches of this config: bulk token truth, the FULL policy
        self._decodes = self.stripes is None and config.token_truth == TokenTruth.CHAIN
        # batches up to this many rows: the CUDA begin_decode passes their staging rows in its launch (no staging row
        # used, so no event to wait for or record)
        self._inline = STAGE_INLINE_ROWS if self._stage.backend == "cuda" else 0

    def steady(self, batch: BatchView, step: int, shape: tuple[int, int]) -> HeldIds | None:
        """A steady batch (forward ``step``, bound ``shape``): every live request holds its row and continues it with
        its new tokens (a decode, a speculative round, the next chunk of a prefill), whose truth is given (the tokens,
        or the engine's own expected chains), under the FULL policy and CHAIN truth. Tokens: checked, hashed and staged
        by one native call (``begin_decode``, docs/ops-contract.md 8c); given chains: staged as they are
        (:meth:`_stage_given`). Returns the batch's request ids as held (a list never changed after: the step's
        attribution); None, with nothing changed, for any other batch (:meth:`begin` takes it). Bad input raises
        CanaryInputError (``BatchView.validate``'s message where it has one) before anything changes. The caller has
        checked the batch's fit (capacities, slot table)."""
        new, given = batch.true_new_tokens, batch.expected_chains
        if not self._chain_rows(batch) or (given is None and new is None):
            return None
        done = False
        try:
            rows = host_i64(batch.req_pool_indices_host)
            held = self._held(rows, batch.request_ids)
            if held is None:
                return None
            pre, ext = host_i64(batch.prefix_lens_host), host_i64(batch.extend_lens_host)
            if given is not None:
                done = self._stage_given(batch, (rows, pre, ext), given, held.live, step, shape)
            elif new is not None:
                done = self._decode(batch, _sources(batch), (held.rows_arg, pre, ext), new, held.live_arg, step, shape)
        except (TypeError, ValueError) as err:  # the native checks: this library's error for the same input
            cfg = self.config
            batch.validate(self.pool, cfg.req_capacity, cfg.token_capacity, self.state.device)
            raise CanaryInputError(f"batch: {err}") from err
        if not done:
            return None
        self.any_new = False  # every request holds its row and continues it, no stripes
        return held.ids

    def begin(self, batch: BatchView, step: int, capture: bool, shape: tuple[int, int]) -> None:
        """Token truth, stripe ends and reuse ends of ``batch`` (forward ``step``) staged with the batch into the static
        buffers, padded to the bound ``shape``, for any batch (a steady batch takes :meth:`steady`). The caller has
        run ``BatchView.validate_fit``; the arrays are checked here before any state changes."""
        batch.validate_arrays(self.state.device)
        ids = batch.request_ids
        rows, pre, ext = host_i64(batch.req_pool_indices_host), host_i64(batch.prefix_lens_host), \
            host_i64(batch.extend_lens_host)
        live = rows != self.pool.padding_row
        if None in ids:
            live &= np.not_equal(request_keys(ids), None)  # type: ignore[call-overload]
        bs, nt = rows.shape[0], batch.num_tokens
        src = _sources(batch)
        inside = (rows >= 0) & (rows < self.pool.req_rows)
        if not all_set(inside):  # rows outside the slot table: the plan counts them as input errors; here they are
            live &= inside       # padding
            rows = np.where(inside, rows, 0)
        keys = request_keys(ids)
        claims = np.flatnonzero(self.requests.unclaimed(rows, keys, live))
        reuse = np.zeros(bs, dtype=np.int64)
        self._claim(rows, keys, claims, pre, capture, reuse)
        if not capture and self._continued(batch, rows, live, pre, ext, src, step, reuse, shape):
            return
        k, out = self._staging_row(bs)
        out[3], out[4] = 0, reuse  # stripe and reuse ends; _truth writes rows 0-2
        if self.stripes is not None:
            self._stripe_ends(keys, live, pre, capture, out[3])
        if capture:  # nothing runs at a capture: its truth is staged, the rows' chains stay where they were
            chains, h, n = self.chains, self.chains.h[rows], self.chains.n[rows]
        self._truth(batch, rows, live, pre, ext, out)
        if capture:
            if self.chains is chains:
                self.chains.h[rows], self.chains.n[rows] = h, n
            else:  # fresh chains for a new token offset: untouched
                self.chains.reset(rows)
        self._stage_row(src, k, bs, nt, shape)
        if not capture:
            self.requests.ran(rows, live, pre, step)

    def _continued(self, batch: BatchView, rows: np.ndarray, live: np.ndarray, pre: np.ndarray, ext: np.ndarray,
                   src: tuple[torch.Tensor, ...], step: int, reuse: np.ndarray, shape: tuple[int, int]) -> bool:
        """The truth and staging of a claimed batch (forward ``step``) in one native call (:meth:`_decode`) once its
        rows that are behind their prefix end (a new request with a reused prefix, a rewound one) have caught up:
        under the FULL policy and CHAIN truth with bulk truth given, when every live row then continues its chain.
        False, with only the catch-up done, otherwise (the caller's numpy path takes the batch)."""
        new = batch.true_new_tokens
        if new is None or batch.expected_chains is not None or not self._chain_rows(batch) or \
                not self.chains.reach(rows, live, pre, batch.true_tokens):
            return False
        return self._decode(batch, src, (rows, pre, ext), new, live, step, shape, reuse)

    def _decode(self, batch: BatchView, src: tuple[torch.Tensor, ...], host: tuple[object, np.ndarray, np.ndarray],
                new: np.ndarray | torch.Tensor, live: object, step: int, shape: tuple[int, int],
                reuse: np.ndarray | None = None) -> bool:
        """``begin_decode`` of a batch whose every live row holds its request (``host``: its rows, prefix and extend
        lengths; ``live``: its live mask; the rows and mask as numpy arrays or in :class:`Held`'s native form;
        ``reuse``: the reuse ends, None: none): True when it staged the batch (every live row continued its chain). A
        batch of at most ``STAGE_INLINE_ROWS`` rows on CUDA carries its staging rows in the launch, so no staging row is
        waited for or taken."""
        bs, nt = host[1].shape[0], batch.input_ids.shape[0]
        k = self._index if bs > self._inline else None
        event = 0 if k is None else self._handles[k]
        if k is not None and self._copied and not event:
            self._copied[k].synchronize()
        got = self._stage.decode(src, self._index, *self._pads(bs, nt, shape), host, host_array(new), live,
                                 self._row_state, self.chains.offset, step, reuse, event)
        if got == BAD_VALUE:
            raise CanaryInputError(f"true tokens / positions must lie in [0, {TOKEN_LIMIT})")
        if got < 0:
            return False
        self._staged(k, bs, nt, shape, recorded=bool(event))
        return True

    def _stage_given(self, batch: BatchView, host: tuple[np.ndarray, ...],
                     given: Sequence[tuple[int | None, int | None]], live: np.ndarray, step: int,
                     shape: tuple[int, int]) -> bool:
        """A held batch with the engine's expected chains: the chains and flag mask into a staging row, one
        ``stage_batch`` (which checks the batch arrays). False, with nothing changed, where the general path must look
        (rows outside the table, host facts that do not fit the batch)."""
        rows, pre, ext = host
        bs, nt = rows.shape[0], batch.input_ids.shape[0]
        if len(given) != bs or not all_set((rows >= 0) & (rows < self.pool.req_rows)) or not extends_fit(ext, nt):
            return False
        k, out = self._staging_row(bs)
        _expect(out, _given_chains(given, live), live, pre)
        out[3:] = 0  # no stripes, no reuse check: every request holds its row
        self._stage_row(_sources(batch), k, bs, nt, shape)  # checks the batch arrays before anything changes
        self.requests.ran(rows, live, pre, step)
        return True

    def _chain_rows(self, batch: BatchView) -> bool:
        """Whether ``batch``'s truth may take a steady path (``begin_decode`` or given chains): the FULL policy and
        CHAIN truth, the rows' token offset."""
        return self._decodes and self._offset(batch) == self.chains.offset

    def _staging_row(self, bs: int) -> tuple[int, np.ndarray]:
        """The staging row the next stage_batch reads, once the launch that read it last has run, and its host view of
        ``bs`` columns."""
        k = self._index
        if self._copied:
            self._copied[k].synchronize()
        return k, self._host[k][:, :bs]

    def _stage_row(self, src: tuple[torch.Tensor, ...], k: int, bs: int, nt: int, shape: tuple[int, int]) -> None:
        """``stage_batch`` of the ``bs`` x ``nt`` batch ``src`` with staging row ``k``, padded to ``shape``."""
        self._stage(src, k, *self._pads(bs, nt, shape))
        self._staged(k, bs, nt, shape)

    def _pads(self, bs: int, nt: int, shape: tuple[int, int]) -> tuple[int, int]:
        """(pad_rows, pad_tokens) of a batch of ``bs`` rows and ``nt`` tokens staged at the bound ``shape``: rows up to
        ``shape[0]`` are padding rows (the pool's padding row, no new tokens), tokens up to ``shape[1]`` have
        out_cache_loc -1. Only what an earlier, larger batch left there is reset (a steady batch resets nothing)."""
        rows, tokens = self._dirty
        return max(bs, min(rows, shape[0])), max(nt, min(tokens, shape[1]))

    def _staged(self, k: int | None, bs: int, nt: int, shape: tuple[int, int], recorded: bool = False) -> None:
        """After staging a ``bs`` x ``nt`` batch with staging row ``k`` (None: none, the launch carried its rows): the
        row's event (``recorded``: by the native op), the next row, what the static buffers may hold."""
        if k is not None:
            self._index ^= 1
            # the row is free again once this launch, which reads it in place, has run
            if self._stream is not None and not recorded:
                self._copied[k].record(self._stream.get())
        # past a bound shape, what the earlier batch left stays (reset once a later shape reaches it)
        r, t = self._dirty
        self._dirty = (bs if r <= shape[0] else r, nt if t <= shape[1] else t)

    def _held(self, rows: np.ndarray, ids: Sequence[Hashable | None]) -> Held | None:
        """The batch as held when every request holds its row (padding: None on a row nobody holds), by a list compare
        (no object ufunc); else None. Rows outside the slot table are not held (begin_decode declines them, the slow
        path checks them). A batch of the last one's rows and ids, with no row changed hands since, gets the last
        answer: a decode stream's batches repeat, and the compares cost microseconds at bs 256."""
        key, last = rows.tobytes(), self._last_held
        if not isinstance(ids, list):  # a list compare only: a tuple never equals a list, an array compares by element
            ids = list(ids)
        if last is not None and last[0] == self.requests.version and last[1] == key and last[2].ids == ids:
            return last[2]
        try:
            held = self.requests.owner[rows].tolist()
        except IndexError:
            return None
        if held != ids:
            return None
        live = rows != self.pool.padding_row
        if None in held:  # a C-level scan: np.not_equal on an object array costs far more
            live &= np.not_equal(request_keys(held), None)  # type: ignore[call-overload]
        # the rows copied: the answer outlives this batch, whose array the engine may reuse
        answer = Held(held, live, self._stage.host(rows.copy()), self._stage.host(live))
        self._last_held = (self.requests.version, key, answer)
        return answer

    def _claim(self, rows: np.ndarray, keys: np.ndarray, claims: np.ndarray, pre: np.ndarray, capture: bool,
               reuse_end: np.ndarray) -> None:
        """Rows taken by requests new to them (their row state reset); a request's first forward verifies its whole
        reused prefix (reuse end = prefix)."""
        self.any_new = False
        if claims.size == 0:
            return
        new, reset = self.requests.claim(rows, keys, claims)
        self._reset(reset)
        fresh = claims[new]
        if fresh.size and not capture:
            self.any_new = True
            reuse_end[fresh] = pre[fresh]

    def _stripe_ends(self, keys: np.ndarray, live: np.ndarray, pre: np.ndarray, capture: bool,
                     out: np.ndarray) -> None:
        if self.stripes is None:
            raise KVCanaryInternalError("stripes are unset: an invariant of the upload was broken")
        cov = None if capture else self.health.coverage
        for i in np.flatnonzero(live).tolist():
            out[i] = self.stripes.end(keys[i], int(pre[i]), cov)

    def _truth(self, batch: BatchView, rows: np.ndarray, live: np.ndarray, pre: np.ndarray, ext: np.ndarray,
               out: np.ndarray) -> None:
        """EXPECT_PREFIX / EXPECT_NEW values and flag mask (CHAIN), or the token pool rows (POOL)."""
        cfg = self.config
        if cfg.token_truth != TokenTruth.CHAIN:
            out[:2], out[2] = 0, NO_PREFIX & NO_NEW
            if cfg.token_truth == TokenTruth.POOL and batch.true_tokens is not None:
                self._pool_truth(batch, rows, live, pre, ext)
            return
        offset = self._offset(batch)
        if offset != self.chains.offset:  # every row's chain restarts (the rows' requests stay theirs)
            self._set_chains(offset)
        if batch.expected_chains is not None:
            t = _given_chains(batch.expected_chains, live)
        elif batch.true_tokens is None and batch.true_new_tokens is None:
            t = BatchTruth(*(np.zeros(rows.shape[0], dt) for dt in (np.int64, np.int64, bool, bool)))
        else:
            new = None if batch.true_new_tokens is None else host_i64(batch.true_new_tokens)
            t = self.chains.forward(rows, live, pre, ext, new, batch.true_tokens)
        _expect(out, t, live, pre)

    def _offset(self, batch: BatchView) -> int:
        return self.pool.token_offset if batch.token_offset is None else batch.token_offset

    def _set_chains(self, offset: int) -> None:
        """Fresh row chains for token ``offset``, and the per-row state begin_decode updates."""
        self.chains = RowChains(self.pool.req_rows, offset, *self._hashers)
        r = self.requests
        self._row_state = self._stage.row_state(self.chains.h, self.chains.n, r.seen, r.prefix)

    def _pool_truth(self, batch: BatchView, rows: np.ndarray, live: np.ndarray, pre: np.ndarray,
                    ext: np.ndarray) -> None:
        """Append each row's not yet uploaded true tokens to its expected-token pool row (per row: its request's
        progress, reset when another request claims it)."""
        st = self.state
        if st.token_pool is None or batch.true_tokens is None:
            raise KVCanaryInternalError("st.token_pool is unset: an invariant of the bracket was broken")
        offset = self._offset(batch)
        width = st.token_pool.tokens.shape[1]
        reqs: list[tuple[int, int, int, Sequence[int]]] = []
        for i in np.flatnonzero(live).tolist():
            row, hist = int(rows[i]), batch.true_tokens[i]
            upto = min(len(hist), int(pre[i] + ext[i]) + offset, width)
            start = min(int(self.pool_done[row]), upto)
            self.pool_done[row] = upto
            reqs.append((row, start, upto - start, hist[start:upto]))
        if reqs:
            self._scatter(reqs)

    def _scatter(self, reqs: list[tuple[int, int, int, Sequence[int]]]) -> None:
        st = self.state
        if st.token_pool is None:
            raise KVCanaryInternalError("st.token_pool is unset: an invariant of the bracket was broken")
        d = st.device
        flat = [t for _, _, _, toks in reqs for t in toks]
        meta = torch.tensor([[r for r, _, _, _ in reqs], [s for _, s, _, _ in reqs], [c for _, _, c, _ in reqs]],
                            dtype=torch.int64).to(d, non_blocking=True)
        tokens = torch.tensor(flat, dtype=torch.int64).to(d, non_blocking=True)
        scatter_tokens(st.token_pool, meta[0], meta[1], meta[2], tokens, st.scatter_status, backend=self.backend)

    def release(self, rid: Hashable) -> None:
        """Forget a finished request: its row, token truth and stripe cursor."""
        row = self.requests.drop(rid)
        if row is not None:
            self._reset([row])
        if self.stripes is not None:
            self.stripes.drop(rid)

    def _reset(self, rows: list[int]) -> None:
        """Per-row truth state of rows that changed hands: the empty chain, no true token uploaded."""
        self.chains.reset(rows)
        self.pool_done[rows] = 0


def _sources(batch: BatchView) -> tuple[torch.Tensor, ...]:
    """The six batch tensors the staging copies, in ``stage_batch``'s order."""
    return (batch.req_pool_indices, batch.prefix_lens, batch.extend_lens, batch.input_ids, batch.positions,
            batch.out_cache_loc)


def _expect(out: np.ndarray, t: BatchTruth, live: np.ndarray, pre: np.ndarray) -> None:
    """Staging rows 0-2: EXPECT_PREFIX / EXPECT_NEW values, and per request the flag mask dropping the unknown ones."""
    out[0], out[1] = t.expect_prefix, t.expect_new
    drop_pre = live & (pre > 0) & ~t.prefix_known
    drop_new = live & ~t.new_known
    if np.count_nonzero(drop_pre) or np.count_nonzero(drop_new):
        out[2] = np.where(drop_pre, NO_PREFIX, KEEP_ALL) & np.where(drop_new, NO_NEW, KEEP_ALL)
    else:
        out[2] = KEEP_ALL  # everything known (a steady decode): no selects


def _given_chains(given: Sequence[tuple[int | None, int | None]], live: np.ndarray) -> BatchTruth:
    """The engine's own expected chains (None = unknown) as a BatchTruth (one step per request)."""
    ep = [0 if p is None else p for p, _ in given]
    en = [0 if n is None else n for _, n in given]
    return BatchTruth(np.asarray(ep, np.int64), np.asarray(en, np.int64),
                      live & np.asarray([p is not None for p, _ in given], bool),
                      live & np.asarray([n is not None for _, n in given], bool))
