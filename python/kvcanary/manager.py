"""The per-forward bracket: install() and CanaryManager (begin/pre/post/end forward, sweeps, reporting)."""

from __future__ import annotations

import enum
import logging
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch
from kvcanary_schema import NUM_LAUNCH_TAGS, Group, Half, LaunchTag, Stage

from kvcanary.adapter import BatchView, EngineAdapter, PoolDescription, PrefixCacheExport, TransferBuffer
from kvcanary.config import CanaryConfig, CanaryMode
from kvcanary.errors import CanaryInputError, KVCanaryError, KVCanaryInternalError
from kvcanary.health import Health
from kvcanary.ops.invalidate import bind_invalidate
from kvcanary.ops.types import check_backend
from kvcanary.perturb import Perturber
from kvcanary.program import DeviceProgram, Op
from kvcanary.report import JsonlSink, LogSink, Metrics, ReportSink, StepBatch, WindowReport
from kvcanary.reporting import Reporter, Snapshot
from kvcanary.state import CanaryState
from kvcanary.sweep import Sweeper, SweepSlice, filter_export
from kvcanary.upload import Upload

logger = logging.getLogger("kvcanary")

PrefixCacheFn = Callable[[], PrefixCacheExport | None]


class CanaryBracketError(KVCanaryError, RuntimeError):
    """The forward bracket was misused (nested, out of order, or a replay that does not match a capture)."""


class ForwardKind(enum.StrEnum):
    """How the device parts of a bracket run: eagerly, being captured into a CUDA graph, or replayed by one."""

    EAGER = "eager"
    CAPTURE = "capture"
    REPLAY = "replay"


PRUNE_HORIZON = 4096  # forwards a request may go unseen before its row state is forgotten
_KINDS: dict[str, ForwardKind] = {k.value: k for k in ForwardKind}


class _Phase(enum.Enum):
    IDLE = 0
    BEGUN = 1
    PRE = 2
    POST = 3


class CanaryManager:
    """Owns the device state of one pool and runs the canary around every forward of the engine.

    Bracket (per forward): ``begin_forward(batch)`` (host: checks, token truth, perturbation, reporting) →
    ``pre_forward()`` (device: plan, HEAD verify + write; capturable) → the engine's forward →
    ``post_forward()`` (device: TAIL verify + write, fingerprints; capturable) → ``end_forward()`` (host:
    post-forward perturbation, sweep, staging of the window). Under CUDA graphs, capture ``pre_forward`` and
    ``post_forward`` with the model, call ``begin_forward(batch, kind="capture")`` around the capture and
    ``begin_forward(batch, kind="replay")`` / ``end_forward()`` around every replay.

    The pieces: :class:`~kvcanary.upload.Upload` (batch and token truth into the static buffers),
    :class:`~kvcanary.program.DeviceProgram` (the device parts, bound once per batch shape) and
    :class:`~kvcanary.reporting.Reporter` (windows, reports, health).
    """

    def __init__(self, pool: PoolDescription, config: CanaryConfig, prefix_cache: PrefixCacheFn | None = None,
                 sinks: Sequence[ReportSink] = ()) -> None:
        self.config = config
        self.pool = pool
        self.enabled = config.mode != CanaryMode.NONE
        self.metrics = Metrics()
        self.sinks: list[ReportSink] = []
        self.health = Health(config.stats_interval, config.watchdog)
        self._phase = _Phase.IDLE
        self._kind = ForwardKind.EAGER
        self.forwards = 0  # host-side forwards (eager + replayed)
        self._reports: deque[WindowReport] = deque(maxlen=64)
        if not self.enabled:
            return
        pool.validate()
        if pool.table_page > 1 and config.perturb.enabled:
            raise CanaryInputError("perturbation edits per-token slot tables: it needs PoolDescription.table_page == 1")
        self.device = pool.resolved_device
        self.backend = check_backend(config.resolved_backend(self.device.type), self.device)
        self.state = CanaryState(pool, config, self.backend)
        self.prefix_cache = prefix_cache
        # the sweeps this install runs (no prefix-cache export: none)
        self._rolling = bool(config.sweep_slice) and prefix_cache is not None
        self._sweep_every = config.sweep_interval if prefix_cache is not None else 0
        self.sweeper = Sweeper(self.state, self.backend, config.sweep_unlocked_only)
        if self._rolling:
            self.sweeper.warm_up()
        self.perturber = Perturber(self.state, config.perturb, config.fingerprint)
        self.sinks = [LogSink(config.log_rate_limit), self.metrics]
        if config.jsonl_path:
            self.sinks.append(JsonlSink(config.jsonl_path))
        self.sinks += list(sinks)
        self.upload = Upload(self.state, pool, config, self.health, self.backend)
        self.program = DeviceProgram(self.state, pool, config, self.backend)
        self.reporter = Reporter(self.state, config, self.health, self.metrics, self.sinks, pool.page_size)
        self.reporter.on_report = self._on_report
        self._reports = self.reporter.reports
        self._variants = [self.health.add_variant(self.program.launches(reuse).numpy()) for reuse in (False, True)]
        self._sweep_variant = self.health.add_variant(self._sweep_launches())
        self._captured: set[tuple[int, int, int]] = set()
        self._invalidates = [bind_invalidate(g.records, g.spec.reserved_slots, self.backend) for g in self.state.groups
                             if g.spec.group == Group.FULL]
        self._table: torch.Tensor | None = None
        self._shape = (0, 0)  # the open forward's bound shape (DeviceProgram.bound_shape)
        self._ops: tuple[tuple[Op, ...], tuple[Op, ...]] = ((), ())
        self._reuse = True
        if config.sweep_interval and prefix_cache is None:
            logger.info("kvcanary: sweep_interval=%d but no prefix-cache export: sweeps are off",
                        config.sweep_interval)
        logger.info("kvcanary installed: mode=%s backend=%s groups=%s halves=%s fingerprint=%s coverage=%s "
                    "token_truth=%s device_bytes=%d", config.mode.value, self.backend,
                    [g.spec.group.name for g in self.state.groups], [g.spec.halves for g in self.state.groups],
                    config.fingerprint.name, config.coverage.value, config.token_truth.name,
                    self.state.device_bytes())

    @property
    def reports(self) -> deque[WindowReport]:
        """The last 64 collected windows."""
        return self._reports

    # ------------------------------------------------------------------ bracket

    def begin_forward(self, batch: BatchView, kind: ForwardKind | str = ForwardKind.EAGER) -> None:
        """Host part before the forward: report the last window, check capacities, upload token truth, perturb."""
        if not self.enabled:
            return
        if self._phase is not _Phase.IDLE:
            raise CanaryBracketError(f"begin_forward while a forward is open (phase {self._phase.name}); "
                                     "brackets do not nest")
        kind = _KINDS.get(kind) or ForwardKind(kind)  # a dict lookup: the enum's call costs microseconds
        if not self._begin_steady(batch, kind):
            self._begin(batch, kind)
        self._batch = batch
        self._kind = kind
        self._phase = _Phase.BEGUN

    def _begin_steady(self, batch: BatchView, kind: ForwardKind) -> bool:
        """The common forward, a steady batch (every request continues its row with its known tokens; nothing to
        perturb, no capture): its checks and upload in one native call (:meth:`Upload.steady`). False, with nothing
        changed, for any other forward (:meth:`_begin` takes it and raises what it finds). The checks of
        ``BatchView.validate`` not made here are implied: the host facts' lengths and the arrays by the native call,
        the request ids by the held rows, the token offset by the row chains' own."""
        cfg, tokens = self.config, batch.input_ids
        if kind is ForwardKind.CAPTURE or self.perturber.enabled or not isinstance(tokens, torch.Tensor):
            return False
        bs, nt, tt = len(batch.req_pool_indices_host), tokens.shape[0], batch.true_tokens
        if bs > cfg.req_capacity or nt > cfg.token_capacity or (tt is not None and len(tt) != bs):
            return False
        batch.check_table(self.pool, self.device, self._table)
        table = batch.req_to_token
        if kind is ForwardKind.REPLAY and (bs, nt, table.data_ptr()) not in self._captured:
            return False
        step = self.forwards + 1
        shape = self.program.bound_shape(bs, nt)
        ids = self.upload.steady(batch, step, shape)
        if ids is None:
            return False
        self._begun(batch, kind, step, shape, table, ids)
        self._report_due()
        return True

    def _begin(self, batch: BatchView, kind: ForwardKind) -> None:
        """begin_forward of any forward: every check, then the perturbation and the upload (:meth:`Upload.begin`)."""
        if kind is ForwardKind.CAPTURE and self.device.type != "cuda":
            raise CanaryBracketError("kind='capture' needs a CUDA device")
        batch.validate_fit(self.pool, self.config.req_capacity, self.config.token_capacity, self.device, self._table)
        bs, nt, table = batch.batch_size, batch.num_tokens, batch.req_to_token
        key = (bs, nt, table.data_ptr())
        if kind is ForwardKind.REPLAY and key not in self._captured:
            raise CanaryBracketError(f"replay of a batch shape (bs={bs}, tokens={nt}) / slot table that was "
                                     "never captured")
        self._report_due()
        step = self.forwards + 1
        capture = kind is ForwardKind.CAPTURE
        if not capture and self.perturber.enabled:
            wants = (self._sweep_due(step) or self._rolling) and self.perturber.wants_export()
            self.perturber.before_forward(batch, step, self._export() if wants else None)
        shape = self.program.bound_shape(bs, nt)
        self.upload.begin(batch, step, capture, shape)
        if capture:
            self._captured.add(key)
        self._begun(batch, kind, step, shape, table, tuple(batch.request_ids))

    def _begun(self, batch: BatchView, kind: ForwardKind, step: int, shape: tuple[int, int],
               table: torch.Tensor, ids: Sequence[Hashable | None]) -> None:
        """After the upload of forward ``step``: its slot table, its requests (``ids``: a copy of the batch's, never
        changed after) for the report, its device stages."""
        self._table, self._shape = table, shape
        if kind is not ForwardKind.CAPTURE:
            offset = self.pool.token_offset if batch.token_offset is None else batch.token_offset
            self.reporter.step_batches[step] = StepBatch(ids, offset)
        if kind is not ForwardKind.REPLAY:
            stages = self.program.stages(table)
            capture = kind is ForwardKind.CAPTURE
            # eager: the reuse check only when a request is new; captured graphs always hold it (a replay may carry
            # a new request, e.g. disaggregated decode)
            self._reuse = capture or (self.upload.any_new and self.program.has_reuse)
            self._ops = (stages["pre", self._reuse], stages["graph", True] if capture else stages["post", self._reuse])

    def _report_due(self) -> None:
        """Before a forward: stage a window whose violation rows have arrived (CUDA: rows of an earlier forward whose
        count arrived since its end_forward), collect the windows that came back."""
        if self.reporter.alarmed():
            self.reporter.stage(self.forwards)
        if self.reporter.pending:
            self.reporter.collect(block=False)

    def pre_forward(self) -> None:
        """Device part before the model forward: plan, HEAD verify and write. No syncs, no allocations."""
        if not self.enabled:
            return
        if self._phase != _Phase.BEGUN or self._kind == ForwardKind.REPLAY:
            raise CanaryBracketError(f"pre_forward needs an open eager/capture forward (phase {self._phase.name}, "
                                     f"kind {self._kind.value})")
        self.program.launch(self._ops[0], self._slot_table(), self._shape, self._kind is ForwardKind.EAGER)
        self._phase = _Phase.PRE

    def post_forward(self) -> None:
        """Device part after the model forward: TAIL verify and write with fingerprints. No syncs, no allocations."""
        if not self.enabled:
            return
        if self._phase != _Phase.PRE:
            raise CanaryBracketError(f"post_forward without pre_forward (phase {self._phase.name})")
        self.program.launch(self._ops[1], self._slot_table(), self._shape, self._kind is ForwardKind.EAGER)
        self._phase = _Phase.POST

    def end_forward(self) -> WindowReport | None:
        """Host part after the forward: post-forward perturbation, sweep when due, staging of the window.

        A window is staged when this forward ends one of ``report_interval`` forwards, or at once when violation rows
        were emitted (CPU: by this forward; CUDA: by an earlier one, once its ring count has arrived). Returns the
        report of a window collected now (CPU: this forward's window; CUDA: an earlier one).
        """
        if not self.enabled:
            return None
        replay = self._kind is ForwardKind.REPLAY
        want = _Phase.BEGUN if replay else _Phase.POST
        if self._phase is not want:
            raise CanaryBracketError(f"end_forward in phase {self._phase.name}, expected {want.name} for a "
                                     f"{self._kind.value} forward")
        self._phase = _Phase.IDLE
        if self._kind is ForwardKind.CAPTURE:
            return None
        f = self.forwards = self.forwards + 1
        self.health.expect_forward(self._variants[replay or self._reuse])
        if self.perturber.enabled:
            self.perturber.after_forward(self._batch, f)
        if self._sweep_due(f):
            self.sweep()
        elif self._rolling and f % self.config.sweep_roll_interval == 0:
            self._roll()
        if f % PRUNE_HORIZON == 0:
            self._prune(f)
        # a window with violation rows is staged at once; clean ones (health, metrics, stats) every report_interval
        rep = self.reporter
        if rep.alarmed() or f % self.config.report_interval == 0:
            rep.stage(f)
        return rep.collect(block=self.device.type != "cuda") if rep.pending else None

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
        self.reporter.sweep_slices[self.forwards] = SweepSlice(filter_export(export, self.sweeper.unlocked_only))
        self.reporter.sweeps_staged += 1
        return True

    def flush(self) -> WindowReport | None:
        """Stage the open window and collect everything in flight (blocking); the last report or None."""
        if not self.enabled:
            return None
        if self._phase != _Phase.IDLE:
            raise CanaryBracketError("flush inside an open forward")
        if self.reporter.has_open_window(self.forwards):
            self.reporter.stage(self.forwards)
        return self.reporter.collect(block=True)

    def release(self, request_id: Hashable) -> None:
        """Forget a finished request's token truth and stripe cursor."""
        if self.enabled:
            self.upload.release(request_id)

    def invalidate(self, slots: torch.Tensor) -> None:
        """Poison the records of freed table-space ``slots`` (FULL groups; SWA slots leave through the map).

        A later read of such a slot fails its position and chain checks, which catches use-after-free and a
        rollback that frees live slots. Reserved slots (and slots outside the pool) are left alone. ``slots``: int32 or
        int64 ids on the canary's device, or on the host (an engine's freed ids: on a CUDA device they travel in the
        launch's parameters). No host sync (the cpu and cuda backends). Call outside any graph capture.
        """
        if not self.enabled:
            return
        for op in self._invalidates:
            op(slots)

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

    # ------------------------------------------------------------------ host parts

    def _slot_table(self) -> torch.Tensor:
        """The slot table of the open forward (set by begin_forward)."""
        if self._table is None:
            raise KVCanaryInternalError("no slot table: a device part ran outside begin_forward")
        return self._table

    def _roll(self) -> None:
        """The rolling sweep's slice (every ``sweep_roll_interval`` forwards; eager, after the forward)."""
        export = self._export()
        sl = self.sweeper.roll(export) if export is not None else None
        if sl is not None:
            self._expect_sweep(1)
            self.reporter.sweep_slices[self.forwards] = sl

    def _sweep_launches(self) -> np.ndarray:
        """[NUM_LAUNCH_TAGS, 2]: the (verify, write) launches of one sweep plan's verifies (TAIL, plus HEAD where
        sealed)."""
        out = np.zeros((NUM_LAUNCH_TAGS, 2), dtype=np.int64)
        for g in self.state.groups:
            for h in range(g.spec.halves):
                out[int(LaunchTag.of(Stage.SWEEP, Half(h), g.spec.group)), 0] = 2 if g.seal is not None else 1
        return out

    def _expect_sweep(self, chunks: int) -> None:
        """Tell the watchdog about ``chunks`` sweep plans verified (one registered table: no per-tag work per slice)."""
        self.health.expect_runs(self._sweep_variant, chunks)

    def _sweep_due(self, step: int) -> bool:
        return bool(self._sweep_every) and step % self._sweep_every == 0

    def _export(self) -> PrefixCacheExport | None:
        return self.prefix_cache() if self.prefix_cache is not None else None

    def _prune(self, step: int) -> None:
        """Every PRUNE_HORIZON forwards: forget requests whose rows have not run for that long."""
        for rid in self.upload.requests.stale(step, PRUNE_HORIZON):
            self.release(rid)
        self.reporter.prune()

    def _on_report(self, report: WindowReport, snap: Snapshot, sweeps: int) -> None:
        """A collected window's bookkeeping: sweeps completed, metrics, the periodic stats line."""
        self.sweeper.completed += sweeps
        if sweeps:
            logger.info("kvcanary: sweep completed (total %d) with results through step %d", self.sweeper.completed,
                        report.last_step)
        m = self.metrics
        m.counters["forwards"] = self.forwards
        m.counters["sweeps_completed"] = self.sweeper.completed
        m.counters["sweep_slices"] = self.sweeper.slices
        m.counters["health_problems"] = len(self.health.problems)
        m.counters["perturbations"] = len(self.perturber.events)
        m.gauges["coverage"], line = self.health.window(report.last_step, snap.counters, self.sweeper.completed,
                                                        self.reporter.violations_total)
        if line:
            logger.info(line)


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
