"""The per-forward bracket: install() and CanaryManager (begin/pre/post/end forward, sweeps, reporting)."""

from __future__ import annotations

import enum
import logging
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from kvcanary_schema import (
    NO_SLOT,
    NUM_COUNTER_COLS,
    NUM_LAUNCH_TAGS,
    NUM_PLAN_STATUS_COLS,
    NUM_VIOLATION_COLS,
    CounterCol,
    FailReason,
    Group,
    Half,
    LaunchTag,
    PlanCol,
    PlanFlag,
    RecordField,
    Stage,
    TokenTruth,
    WriteCheck,
)

from kvcanary.adapter import BatchView, EngineAdapter, PoolDescription, PrefixCacheExport, TransferBuffer
from kvcanary.config import CanaryConfig, CanaryMode, CoveragePolicy
from kvcanary.errors import CanaryInputError, KVCanaryError, KVCanaryInternalError
from kvcanary.health import CanaryHealthError, Health, HealthProblem
from kvcanary.ops.plan import plan_forward
from kvcanary.ops.scatter_tokens import scatter_tokens
from kvcanary.ops.types import check_backend
from kvcanary.ops.verify import verify
from kvcanary.ops.write import write
from kvcanary.perturb import Perturber
from kvcanary.report import (
    CanaryViolationError,
    JsonlSink,
    LogSink,
    Metrics,
    ReportSink,
    StepBatch,
    Violation,
    WindowReport,
    decode_rows,
)
from kvcanary.state import CanaryState, GroupState
from kvcanary.sweep import Sweeper, SweepSlice, filter_export
from kvcanary.truth import ChainHasher, chain_truth

logger = logging.getLogger("kvcanary")

PrefixCacheFn = Callable[[], PrefixCacheExport | None]
_KEEP_ALL = -1  # flag mask keeping every PlanFlag bit
_NO_PREFIX = ~int(PlanFlag.EXPECT_PREFIX)
_NO_NEW = ~int(PlanFlag.EXPECT_NEW)
_SNAP_COUNTERS = NUM_LAUNCH_TAGS * NUM_COUNTER_COLS


class CanaryBracketError(KVCanaryError, RuntimeError):
    """The forward bracket was misused (nested, out of order, or a replay that does not match a capture)."""


class ForwardKind(enum.StrEnum):
    """How the device parts of a bracket run: eagerly, being captured into a CUDA graph, or replayed by one."""

    EAGER = "eager"
    CAPTURE = "capture"
    REPLAY = "replay"


class _Phase(enum.Enum):
    IDLE = 0
    BEGUN = 1
    PRE = 2
    POST = 3


@dataclass
class _Pending:
    """A staged window whose snapshot is in flight to the host."""

    index: int
    first_step: int
    last_step: int
    expected: torch.Tensor
    expected_forwards: int
    sweeps: int


class CanaryManager:
    """Owns the device state of one pool and runs the canary around every forward of the engine.

    Bracket (per forward): ``begin_forward(batch)`` (host: checks, token truth, perturbation, reporting) →
    ``pre_forward()`` (device: plan, HEAD verify + write; capturable) → the engine's forward →
    ``post_forward()`` (device: TAIL verify + write, fingerprints; capturable) → ``end_forward()`` (host:
    post-forward perturbation, sweep, staging of the window). Under CUDA graphs, capture ``pre_forward`` and
    ``post_forward`` with the model, call ``begin_forward(batch, kind="capture")`` around the capture and
    ``begin_forward(batch, kind="replay")`` / ``end_forward()`` around every replay.
    """

    def __init__(self, pool: PoolDescription, config: CanaryConfig, prefix_cache: PrefixCacheFn | None = None,
                 sinks: Sequence[ReportSink] = ()) -> None:
        self.config = config
        self.pool = pool
        self.enabled = config.mode != CanaryMode.NONE
        self.metrics = Metrics()
        self.reports: deque[WindowReport] = deque(maxlen=64)
        self.sinks: list[ReportSink] = []
        self.health = Health(config.stats_interval, config.watchdog)
        self._phase = _Phase.IDLE
        self._kind = ForwardKind.EAGER
        self.forwards = 0  # host-side forwards (eager + replayed)
        if not self.enabled:
            return
        pool.validate()
        if pool.table_page > 1 and config.perturb.enabled:
            raise CanaryInputError("perturbation edits per-token slot tables: it needs PoolDescription.table_page == 1")
        self.device = pool.resolved_device
        self.backend = check_backend(config.resolved_backend(self.device.type), self.device)
        self.state = CanaryState(pool, config)
        self.prefix_cache = prefix_cache
        self.sweeper = Sweeper(self.state, self.backend, config.sweep_unlocked_only)
        self.hasher = ChainHasher(pool.token_offset)
        self.perturber = Perturber(self.state, config.perturb, config.fingerprint)
        self.sinks = [LogSink(config.log_rate_limit), self.metrics]
        if config.jsonl_path:
            self.sinks.append(JsonlSink(config.jsonl_path))
        self.sinks += list(sinks)
        self._checks = (int(WriteCheck.CHAIN_POSITION) if config.chain_position_assert else 0) | \
            (int(WriteCheck.INPUTS) if config.input_asserts else 0)
        # the structural check is a table-space property of the batch: once per forward (HEAD, first group)
        self._structural = int(WriteCheck.STRUCTURAL) if config.structural_check else 0
        self._bs = 0
        self._nt = 0
        self._mask_needed = True
        self._table: torch.Tensor | None = None
        self._captured: set[tuple[int, int, int]] = set()
        self._step_batches: dict[int, StepBatch] = {}
        self._sweep_slices: dict[int, SweepSlice] = {}  # step -> what its sweep verified (names the chains)
        self._pool_rows: dict[Hashable, tuple[int, int]] = {}  # POOL truth: request -> (row, tokens uploaded)
        self._cursor: dict[Hashable, tuple[int, int]] = {}  # WINDOW policy: request -> (cursor, pass end)
        self._last_seen: dict[Hashable, int] = {}
        self._window_first = 1
        self._stage_next = 0
        self._pending: deque[_Pending] = deque()
        self._upload_index = 0
        self._upload_events: list[object | None] = [None, None]
        self._sweeps_staged = 0
        self._last_counters: list[list[int]] = [[0] * NUM_COUNTER_COLS for _ in range(NUM_LAUNCH_TAGS)]
        self._violations_total = 0
        self._per_forward = self._launches_per_forward()
        size = self.state.snapshot.numel()
        pin = self.device.type == "cuda"
        self._snap_dev = [torch.zeros(size, dtype=torch.int64, device=self.device) for _ in range(2)]
        self._snap_host = [torch.zeros(size, dtype=torch.int64, pin_memory=pin) if pin else self._snap_dev[i]
                           for i in range(2)]
        self._snap_events: list[object | None] = [None, None]
        if config.sweep_interval and prefix_cache is None:
            logger.info("kvcanary: sweep_interval=%d but no prefix-cache export: sweeps are off",
                        config.sweep_interval)
        logger.info("kvcanary installed: mode=%s backend=%s groups=%s halves=%s fingerprint=%s coverage=%s "
                    "token_truth=%s device_bytes=%d", config.mode.value, self.backend,
                    [g.spec.group.name for g in self.state.groups], [g.spec.halves for g in self.state.groups],
                    config.fingerprint.name, config.coverage.value, config.token_truth.name,
                    self.state.device_bytes())

    # ------------------------------------------------------------------ bracket

    def begin_forward(self, batch: BatchView, kind: ForwardKind | str = ForwardKind.EAGER) -> None:
        """Host part before the forward: report the last window, check capacities, upload token truth, perturb."""
        if not self.enabled:
            return
        if self._phase != _Phase.IDLE:
            raise CanaryBracketError(f"begin_forward while a forward is open (phase {self._phase.name}); "
                                     "brackets do not nest")
        kind = ForwardKind(kind)
        st = self.state
        if kind == ForwardKind.CAPTURE and self.device.type != "cuda":
            raise CanaryBracketError("kind='capture' needs a CUDA device")
        batch.validate(self.pool, self.config.req_capacity, self.config.token_capacity)
        key = (batch.batch_size, batch.num_tokens, batch.req_to_token.data_ptr())
        if kind == ForwardKind.REPLAY and key not in self._captured:
            raise CanaryBracketError(f"replay of a batch shape (bs={key[0]}, tokens={key[1]}) / slot table that was "
                                     "never captured")
        self._collect_ready(block=False)
        step = self.forwards + 1
        sweep_due = self._sweep_due(step)
        if kind != ForwardKind.CAPTURE:
            wants = (sweep_due or self._rolling) and self.perturber.wants_export()
            self.perturber.before_forward(batch, step, self._export() if wants else None)
        self._upload(batch, kind)
        bs, nt = batch.batch_size, batch.num_tokens
        st.req_pool_indices[:bs].copy_(batch.req_pool_indices, non_blocking=True)
        st.prefix_lens[:bs].copy_(batch.prefix_lens, non_blocking=True)
        st.extend_lens[:bs].copy_(batch.extend_lens, non_blocking=True)
        st.input_ids[:nt].copy_(batch.input_ids, non_blocking=True)
        st.positions[:nt].copy_(batch.positions, non_blocking=True)
        st.out_cache_loc[:nt].copy_(batch.out_cache_loc, non_blocking=True)
        self._bs, self._nt, self._table = bs, nt, batch.req_to_token
        if kind == ForwardKind.CAPTURE:
            self._captured.add(key)
        else:
            offset = self.pool.token_offset if batch.token_offset is None else batch.token_offset
            self._step_batches[step] = StepBatch(tuple(batch.request_ids), offset)
        self._batch = batch
        self._kind = kind
        self._phase = _Phase.BEGUN

    def pre_forward(self) -> None:
        """Device part before the model forward: plan, HEAD verify and write. No syncs, no allocations."""
        if not self.enabled:
            return
        if self._phase != _Phase.BEGUN or self._kind == ForwardKind.REPLAY:
            raise CanaryBracketError(f"pre_forward needs an open eager/capture forward (phase {self._phase.name}, "
                                     f"kind {self._kind.value})")
        st = self.state
        st.pre_tick.add_(1)  # step counter and pre-forward phase
        for gi, g in enumerate(st.groups):
            self._plan(g)
            self._verify(g, Stage.HEAD)
            if g.seal is None:  # sealed HEAD records are written after the forward, with the seal
                self._write(g, Stage.HEAD)
            torch.maximum(st.window_status[gi], g.status, out=st.window_status[gi])
        self._phase = _Phase.PRE

    def post_forward(self) -> None:
        """Device part after the model forward: TAIL verify and write with fingerprints. No syncs, no allocations."""
        if not self.enabled:
            return
        if self._phase != _Phase.PRE:
            raise CanaryBracketError(f"post_forward without pre_forward (phase {self._phase.name})")
        st = self.state
        for g in st.groups:
            if g.seal is not None:
                self._write(g, Stage.HEAD)
            if g.reuse_plan is not None and g.reuse_status is not None:
                verify(g.head, Stage.TAIL, g.reuse_plan, g.reuse_status, self._slot_table(), st.sink,
                       fingerprint=g.seal, table_page=self.pool.table_page, backend=self.backend)
            self._verify(g, Stage.TAIL)
            self._write(g, Stage.TAIL)
        st.post_tick.add_(1)
        self._phase = _Phase.POST

    def end_forward(self) -> WindowReport | None:
        """Host part after the forward: post-forward perturbation, sweep when due, staging of the window.

        Returns the report of a window collected now (CPU: this forward's window; CUDA: an earlier one).
        """
        if not self.enabled:
            return None
        want = _Phase.BEGUN if self._kind == ForwardKind.REPLAY else _Phase.POST
        if self._phase != want:
            raise CanaryBracketError(f"end_forward in phase {self._phase.name}, expected {want.name} for a "
                                     f"{self._kind.value} forward")
        self._phase = _Phase.IDLE
        if self._kind == ForwardKind.CAPTURE:
            return None
        self.forwards += 1
        self.health.expected_forwards += 1
        self.health.expect_all(self._per_forward)
        self.perturber.after_forward(self._batch, self.forwards)
        if self._sweep_due(self.forwards):
            self.sweep()
        elif self._rolling:
            self._roll()
        self._prune(self.forwards)
        if self.forwards % self.config.report_interval == 0:
            self._stage()
            return self._collect_ready(block=self.device.type != "cuda")
        return None

    @contextmanager
    def forward(self, batch: BatchView, kind: ForwardKind | str = ForwardKind.EAGER) -> Iterator[CanaryManager]:
        """``with manager.forward(batch): pre_forward(); model(); post_forward()`` — begin and end around it."""
        self.begin_forward(batch, kind)
        ok = False
        try:
            yield self
            ok = True
        finally:
            if ok:
                self.end_forward()
            elif self.enabled:
                self._phase = _Phase.IDLE

    # ------------------------------------------------------------------ public helpers

    def sweep(self, export: PrefixCacheExport | None = None) -> bool:
        """Verify every cached chain now (eager); False when there is nothing to sweep (no export)."""
        if not self.enabled:
            return False
        if self._phase != _Phase.IDLE:
            raise CanaryBracketError("sweep inside an open forward")
        export = export if export is not None else self._export()
        if export is None:
            return False
        self._expect_sweep(self.sweeper.run(export))
        self._sweep_slices[self.forwards] = SweepSlice(filter_export(export, self.sweeper.unlocked_only))
        self._sweeps_staged += 1
        return True

    def flush(self) -> WindowReport | None:
        """Stage the open window and collect everything in flight (blocking); the last report or None."""
        if not self.enabled:
            return None
        if self._phase != _Phase.IDLE:
            raise CanaryBracketError("flush inside an open forward")
        if self._window_first <= self.forwards or self._sweeps_staged:
            self._stage()
        return self._collect_ready(block=True)

    def release(self, request_id: Hashable) -> None:
        """Forget a finished request's token truth and stripe cursor."""
        if not self.enabled:
            return
        self.hasher.drop(request_id)
        self._pool_rows.pop(request_id, None)
        self._cursor.pop(request_id, None)
        self._last_seen.pop(request_id, None)

    def invalidate(self, slots: torch.Tensor) -> None:
        """Poison the records of freed table-space ``slots`` (FULL groups; SWA slots leave through the map).

        A later read of such a slot fails its position and chain checks, which catches use-after-free and a
        rollback that frees live slots. Reserved slots are left alone. Call outside any graph capture.
        """
        if not self.enabled:
            return
        for g in self.state.groups:
            if g.spec.group != Group.FULL:
                continue
            idx = slots[slots >= g.spec.reserved_slots].to(device=self.state.device, dtype=torch.int64)
            for view in (g.head, g.tail):
                view.records.index_fill_(0, idx, 0)
                # no planned position is negative, so any verify of the slot reports VERIFY_POSITION
                view.records[idx, :, RecordField.POSITION] = NO_SLOT

    def add_sink(self, sink: ReportSink) -> None:
        """Also send every window to ``sink``."""
        self.sinks.append(sink)

    def transfer_buffers(self) -> list[TransferBuffer]:
        """Canary record buffers (per group, HEAD and TAIL) to send with the KV in a prefill->decode transfer."""
        return self.state.transfer_buffers() if self.enabled else []

    @property
    def sweeps_completed(self) -> int:
        """Sweeps whose results came back."""
        return self.sweeper.completed if self.enabled else 0

    # ------------------------------------------------------------------ device parts

    def _slot_table(self) -> torch.Tensor:
        """The slot table of the open forward (set by begin_forward)."""
        if self._table is None:
            raise KVCanaryInternalError("no slot table: a device part ran outside begin_forward")
        return self._table

    def _plan(self, g: GroupState) -> None:
        st, bs, nt, cfg = self.state, self._bs, self._nt, self.config
        chain = cfg.token_truth == TokenTruth.CHAIN
        window = g.window if g.stripe_plan is None else cfg.window_links
        plan_forward(g.plan, g.status, st.req_pool_indices[:bs], st.prefix_lens[:bs], st.extend_lens[:bs],
                     self._slot_table(), nt, window=window, padding_row=self.pool.padding_row,
                     expect_prefix=st.expect_prefix[:bs] if chain else None,
                     expect_new=st.expect_new[:bs] if chain else None, table_page=self.pool.table_page,
                     backend=self.backend)
        if chain and (self._mask_needed or self._kind == ForwardKind.CAPTURE):  # EXPECT_* only where truth is known
            torch.clamp(g.plan[:, PlanCol.BATCH_INDEX], 0, cfg.req_capacity - 1, out=st.seg_index)
            torch.index_select(st.flag_mask, 0, st.seg_index, out=st.seg_mask)
            g.plan[:, PlanCol.FLAGS].bitwise_and_(st.seg_mask)
        if g.stripe_plan is not None and g.stripe_status is not None:
            plan_forward(g.stripe_plan, g.stripe_status, st.req_pool_indices[:bs], st.stripe_end[:bs],
                         st.zeros[:bs], self._slot_table(), nt, window=cfg.stripe_size,
                         padding_row=self.pool.padding_row, table_page=self.pool.table_page, backend=self.backend)
        if g.reuse_plan is not None and g.reuse_status is not None:  # [0, reuse_end): the whole reused prefix
            plan_forward(g.reuse_plan, g.reuse_status, st.req_pool_indices[:bs], st.reuse_end[:bs], st.zeros[:bs],
                         self._slot_table(), nt, window=0, padding_row=self.pool.padding_row,
                         table_page=self.pool.table_page, backend=self.backend)

    def _verify(self, g: GroupState, stage: Stage) -> None:
        st = self.state
        fp = g.fingerprint if stage == Stage.TAIL else None
        page = self.pool.table_page
        verify(g.views(stage), stage, g.plan, g.status, self._slot_table(), st.sink, token_pool=st.token_pool,
               fingerprint=fp, table_page=page, backend=self.backend)
        if g.stripe_plan is not None and g.stripe_status is not None:
            verify(g.views(stage), stage, g.stripe_plan, g.stripe_status, self._slot_table(), st.sink,
                   token_pool=st.token_pool, fingerprint=fp, table_page=page, backend=self.backend)

    def _write(self, g: GroupState, stage: Stage) -> None:
        st, nt = self.state, self._nt
        checks = self._checks | (self._structural if stage == Stage.HEAD and g is st.groups[0] else 0)
        write(g.views(stage), stage, g.plan, g.status, self._slot_table(), st.input_ids[:nt], st.positions[:nt],
              st.out_cache_loc[:nt], st.sink, checks=checks, token_pool=st.token_pool,
              fingerprint=g.fingerprint if stage == Stage.TAIL else g.seal, table_page=self.pool.table_page,
              backend=self.backend)

    def _launches_per_forward(self) -> torch.Tensor:
        """[NUM_LAUNCH_TAGS, 2]: (verify, write) launches one forward makes per tag."""
        out = torch.zeros(NUM_LAUNCH_TAGS, 2, dtype=torch.int64)
        for g in self.state.groups:
            verifies = 2 if g.stripe_plan is not None else 1
            for stage in (Stage.HEAD, Stage.TAIL):
                reuse = int(stage == Stage.TAIL and g.reuse_plan is not None)
                for h in range(g.spec.halves):
                    out[int(LaunchTag.of(stage, Half(h), g.spec.group))] += torch.tensor([verifies + reuse, 1])
        return out

    # ------------------------------------------------------------------ host parts

    @property
    def _rolling(self) -> bool:
        return bool(self.config.sweep_slice) and self.prefix_cache is not None

    def _roll(self) -> None:
        """The rolling sweep's slice of this forward (eager, after the forward)."""
        export = self._export()
        sl = self.sweeper.roll(export) if export is not None else None
        if sl is not None:
            self._expect_sweep(1)
            self._sweep_slices[self.forwards] = sl

    def _expect_sweep(self, chunks: int) -> None:
        """Tell the watchdog about ``chunks`` sweep plans verified (TAIL, plus HEAD where sealed)."""
        for g in self.state.groups:
            for h in range(g.spec.halves):
                runs = chunks * (2 if g.seal is not None else 1)
                self.health.expect(int(LaunchTag.of(Stage.SWEEP, Half(h), g.spec.group)), runs, 0)

    def _sweep_due(self, step: int) -> bool:
        iv = self.config.sweep_interval
        return bool(iv) and self.prefix_cache is not None and step % iv == 0

    def _export(self) -> PrefixCacheExport | None:
        return self.prefix_cache() if self.prefix_cache is not None else None

    def _upload(self, batch: BatchView, kind: ForwardKind) -> None:
        """Token truth (chain values / expected-token pool) and stripe ends into the static buffers."""
        cfg, st, bs = self.config, self.state, batch.batch_size
        truth = batch.true_tokens if cfg.token_truth != TokenTruth.OFF else None
        given = batch.expected_chains is not None and cfg.token_truth == TokenTruth.CHAIN
        offset = self.pool.token_offset if batch.token_offset is None else batch.token_offset
        if offset != self.hasher.offset:
            self.hasher = ChainHasher(offset)
        stripe = cfg.coverage == CoveragePolicy.WINDOW
        chain = given or (truth is not None and cfg.token_truth == TokenTruth.CHAIN)
        rows: list[list[int]] = [[0] * bs, [0] * bs, [_KEEP_ALL] * bs, [0] * bs, [0] * bs]
        pool_req: list[tuple[int, int, int, Sequence[int]]] = []
        for i in range(bs):
            rid, row = batch.request_ids[i], batch.req_pool_indices_host[i]
            pre, ext = batch.prefix_lens_host[i], batch.extend_lens_host[i]
            if rid is None or row == self.pool.padding_row:
                continue  # no segment is planned for it: its flags do not matter
            if rid not in self._last_seen and kind != ForwardKind.CAPTURE:
                rows[4][i] = pre  # a new request: its whole (reused) prefix is checked against the seal
            self._last_seen[rid] = self.forwards + 1
            if stripe:
                rows[3][i] = self._stripe(rid, pre, kind)
            elif kind != ForwardKind.CAPTURE:
                self.health.coverage.observe(rid, pre, pre)
            if chain and batch.expected_chains is not None:
                rows[0][i], rows[1][i], rows[2][i] = _chain_row(pre, *batch.expected_chains[i])
                continue
            if truth is None:
                rows[2][i] = _NO_PREFIX & _NO_NEW
                continue
            hist = truth[i]
            if chain:
                rows[0][i], rows[1][i], rows[2][i] = self._chain_truth(rid, hist, pre, ext, offset)
            else:
                pool_req.append(self._pool_truth(rid, row, hist, pre + ext + offset))
        if not chain:
            rows[2] = [_NO_PREFIX & _NO_NEW] * bs
        self._mask_needed = any(v != _KEEP_ALL for v in rows[2])
        k = self._upload_index
        self._upload_index ^= 1
        ev = self._upload_events[k]
        if ev is not None:
            ev.synchronize()  # type: ignore[attr-defined]
        host = st.upload[k]
        host[:, :bs].copy_(torch.tensor(rows, dtype=torch.int64))
        st.truth_rows[:, :bs].copy_(host[:, :bs], non_blocking=True)
        if self.device.type == "cuda":
            e = torch.cuda.Event()  # type: ignore[no-untyped-call]
            e.record()
            self._upload_events[k] = e
        if pool_req:
            self._scatter(pool_req)

    def _chain_truth(self, rid: Hashable, hist: Sequence[int], pre: int, ext: int, offset: int) -> tuple[int, int, int]:
        """(expect_prefix, expect_new, flag mask) from the true history, in O(new tokens)."""
        return _chain_row(pre, *chain_truth(self.hasher, rid, hist, pre, ext, offset))

    def _pool_truth(self, rid: Hashable, row: int, hist: Sequence[int], need: int) -> tuple[int, int, int,
                                                                                             Sequence[int]]:
        """(row, start, count, tokens) appending the request's not yet uploaded true tokens to its pool row."""
        prev_row, done = self._pool_rows.get(rid, (row, 0))
        if prev_row != row:
            done = 0
        upto = min(len(hist), need, self.state.token_pool.tokens.shape[1] if self.state.token_pool else 0)
        start = min(done, upto)
        self._pool_rows[rid] = (row, upto)
        return row, start, upto - start, hist[start:upto]

    def _scatter(self, reqs: list[tuple[int, int, int, Sequence[int]]]) -> None:
        st = self.state
        if st.token_pool is None:
            raise KVCanaryInternalError("st.token_pool is unset: an invariant of the bracket was broken")
        d = self.device
        flat = [t for _, _, _, toks in reqs for t in toks]
        meta = torch.tensor([[r for r, _, _, _ in reqs], [s for _, s, _, _ in reqs], [c for _, _, c, _ in reqs]],
                            dtype=torch.int64).to(d, non_blocking=True)
        tokens = torch.tensor(flat, dtype=torch.int64).to(d, non_blocking=True)
        scatter_tokens(st.token_pool, meta[0], meta[1], meta[2], tokens, st.scatter_status, backend=self.backend)

    def _stripe(self, rid: Hashable, pre: int, kind: ForwardKind) -> int:
        """WINDOW policy: end of this forward's stripe of older slots.

        A host cursor per request walks ``[0, pass_end)`` in steps of ``stripe_size``, where ``pass_end`` is the
        count of older slots when the pass began; then a new pass starts at 0. So an older slot corrupted at any
        time is verified within 2 * ceil((P - window_links) / stripe_size) forwards of its request (P = prefix
        length then), within ceil(...) when the prefix does not grow; slots of idle cached chains are the
        sweep's (within ``sweep_interval`` forwards).
        """
        cfg = self.config
        older = max(0, pre - cfg.window_links)
        if older == 0:
            if kind != ForwardKind.CAPTURE:
                self.health.coverage.observe(rid, pre, pre)
            return 0
        cur, pass_end = self._cursor.get(rid, (0, 0))
        if cur >= pass_end or pass_end > older:  # start a pass (also after a rewind of the prefix)
            cur, pass_end = 0, older
        end = min(pass_end, cur + cfg.stripe_size)
        if kind != ForwardKind.CAPTURE:
            self._cursor[rid] = (end, pass_end)
            self.health.coverage.observe(rid, pre, min(pre, cfg.window_links) + min(cfg.stripe_size, end))
        return end

    def _prune(self, step: int, horizon: int = 4096) -> None:
        if step % horizon:
            return
        stale = [rid for rid, seen in self._last_seen.items() if step - seen > horizon]
        for rid in stale:
            self.release(rid)
        for s in [s for s in self._step_batches if s < self._window_first - 2 * self.config.report_interval]:
            del self._step_batches[s]

    # ------------------------------------------------------------------ reporting

    def _stage(self) -> None:
        """Snapshot counters, ring and plan status of the window on the main stream, reset the ring; copy out."""
        st = self.state
        k = self._stage_next
        self._stage_next ^= 1
        ev = self._snap_events[k]
        if ev is not None:  # the buffer's previous window must have been collected
            self._collect_ready(block=True)
        snap = self._snap_dev[k]
        snap.copy_(st.snapshot)
        st.reset_span.zero_()
        if self.device.type == "cuda":
            stream = st.stream
            if stream is None:
                raise KVCanaryInternalError("stream is unset: an invariant of the bracket was broken")
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._snap_host[k].copy_(snap, non_blocking=True)
                e = torch.cuda.Event()  # type: ignore[no-untyped-call]
                e.record(stream)
            self._snap_events[k] = e
        else:
            self._snap_events[k] = True
        self._pending.append(_Pending(k, self._window_first, self.forwards, self.health.expected.clone(),
                                      self.health.expected_forwards, self._sweeps_staged))
        self._sweeps_staged = 0
        self._window_first = self.forwards + 1

    def _quarantine(self, rows: Sequence[Violation]) -> tuple[int, ...]:
        """Table-space slots whose KV or record a kept row found bad (INPUT_ERROR rows name no real slot)."""
        bad: set[int] = set()
        swa_maps: dict[int, torch.Tensor] = {}  # one host copy per SWA group, not one per row
        for v in rows:
            if int(v.reasons) & ~int(FailReason.INPUT_ERROR) == 0:
                continue
            g = next((g for g in self.state.groups if g.spec.group == v.tag.group), None)
            if g is None or v.slot < g.spec.reserved_slots:
                continue
            if g.spec.swa_map is None:
                bad.add(v.slot)
            else:  # SWA rows name the SWA slot: the table slots mapped to it
                host = swa_maps.setdefault(int(g.spec.group), g.spec.swa_map.cpu())
                bad.update(int(t) for t in torch.nonzero(host == v.slot).flatten().tolist())
        return tuple(sorted(bad))

    def _collect_ready(self, block: bool) -> WindowReport | None:
        last = None
        while self._pending:
            p = self._pending[0]
            ev = self._snap_events[p.index]
            if isinstance(ev, torch.cuda.Event):
                if not block and not ev.query():  # type: ignore[no-untyped-call]
                    break
                ev.synchronize()
            self._pending.popleft()
            self._snap_events[p.index] = None
            last = self._report(p)
        return last

    def _report(self, p: _Pending) -> WindowReport:
        cfg, st = self.config, self.state
        snap = self._snap_host[p.index]
        n_groups = len(st.groups)
        head = snap[:_SNAP_COUNTERS + 3 + n_groups * NUM_PLAN_STATUS_COLS].tolist()  # layout: CanaryState.arena
        phase = head[0:2]
        counters = [head[2 + t * NUM_COUNTER_COLS:2 + (t + 1) * NUM_COUNTER_COLS] for t in range(NUM_LAUNCH_TAGS)]
        ring_total = head[2 + _SNAP_COUNTERS]
        o = _SNAP_COUNTERS + 3
        plan_status = [head[o + g * NUM_PLAN_STATUS_COLS:o + (g + 1) * NUM_PLAN_STATUS_COLS] for g in range(n_groups)]
        o += n_groups * NUM_PLAN_STATUS_COLS
        kept_n = min(ring_total, cfg.ring_capacity)
        kept = snap[o:o + kept_n * NUM_VIOLATION_COLS].view(kept_n, NUM_VIOLATION_COLS)
        delta = [[c - last for c, last in zip(row, prev, strict=True)]
                 for row, prev in zip(counters, self._last_counters, strict=True)]
        self._last_counters = counters
        by_tag = {LaunchTag(t): row[CounterCol.VIOLATIONS] for t, row in enumerate(delta) if row[CounterCol.VIOLATIONS]}
        total = sum(by_tag.values())
        self._violations_total += total
        rows = decode_rows(kept, self._step_batches, self._sweep_slices) if kept_n else []
        report = WindowReport(p.first_step, p.last_step, rows, total, ring_total,
                              max(0, ring_total - cfg.ring_capacity), by_tag, torch.tensor(delta, dtype=torch.int64),
                              self._quarantine(rows), self.pool.page_size)
        for s in range(p.first_step, p.last_step + 1):
            self._step_batches.pop(s, None)
        for s in [s for s in self._sweep_slices if s <= p.last_step]:
            del self._sweep_slices[s]
        self.sweeper.completed += p.sweeps
        if p.sweeps:
            logger.info("kvcanary: sweep completed (total %d) with results through step %d", self.sweeper.completed,
                        p.last_step)
        saved = self.health.expected
        self.health.expected = p.expected
        saved_fw = self.health.expected_forwards
        self.health.expected_forwards = p.expected_forwards
        problems = self.health.check(counters, phase, plan_status, report.dropped, cfg.ring_capacity)
        self.health.expected, self.health.expected_forwards = saved, saved_fw
        self.metrics.counters["forwards"] = self.forwards
        self.metrics.counters["sweeps_completed"] = self.sweeper.completed
        self.metrics.counters["sweep_slices"] = self.sweeper.slices
        self.metrics.counters["health_problems"] += len(problems)
        self.metrics.counters["perturbations"] = len(self.perturber.events)
        self.metrics.gauges["coverage"] = self.health.coverage.fraction()
        self.reports.append(report)
        self._dispatch(report, problems)
        line = self.health.stats(p.last_step, counters, self.sweeper.completed, self._violations_total)
        if line:
            logger.info(line)
        return report

    def _dispatch(self, report: WindowReport, problems: list[HealthProblem]) -> None:
        raising = self.config.mode == CanaryMode.RAISE
        for sink in self.sinks:
            if report.total == 0 and sink is not self.metrics:
                continue
            try:
                sink(report)
            except Exception:  # a broken sink must not take the engine down in LOG mode
                if raising:
                    raise
                logger.exception("kvcanary: report sink %r failed", sink)
        for pr in problems:
            logger.warning(pr.message)
        if not raising:
            return
        if report.total:
            raise CanaryViolationError(report)
        hard = [pr for pr in problems if pr.kind in ("watchdog", "phase")]
        if hard:
            raise CanaryHealthError("; ".join(pr.message for pr in hard))


def _chain_row(pre: int, ep: int | None, en: int | None) -> tuple[int, int, int]:
    """(expect_prefix, expect_new, flag mask) of one request: unknown values drop their EXPECT_* flag."""
    mask = (_NO_PREFIX if pre > 0 and ep is None else _KEEP_ALL) & (_NO_NEW if en is None else _KEEP_ALL)
    return ep or 0, en or 0, mask


def install(pool: PoolDescription | EngineAdapter, config: CanaryConfig | None = None, *,
            prefix_cache: PrefixCacheFn | None = None, sinks: Sequence[ReportSink] = ()) -> CanaryManager:
    """Allocate every device buffer once and return the manager (mode NONE: a manager whose bracket does nothing).

    ``pool`` is a PoolDescription, or an EngineAdapter whose prefix-cache export feeds the sweep.
    ``config`` defaults to ``CanaryConfig.from_env()``.
    """
    cfg = config if config is not None else CanaryConfig.from_env()
    if not isinstance(pool, PoolDescription):
        adapter = pool
        pool = adapter.pool_description()
        if prefix_cache is None:
            prefix_cache = adapter.prefix_cache_export
    if not isinstance(pool, PoolDescription):
        raise CanaryInputError(f"install needs a PoolDescription or an EngineAdapter, got {type(pool).__name__}")
    return CanaryManager(pool, cfg, prefix_cache, sinks)
