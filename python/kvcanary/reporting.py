"""Report staging: snapshot a window's device counters and ring, bring them to the host, decode, check, dispatch."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from kvcanary_schema import (
    NUM_COUNTER_COLS,
    NUM_LAUNCH_TAGS,
    NUM_PLAN_STATUS_COLS,
    NUM_VIOLATION_COLS,
    CounterCol,
    FailReason,
    LaunchTag,
)

from kvcanary.config import CanaryConfig, CanaryMode
from kvcanary.errors import KVCanaryInternalError
from kvcanary.health import CanaryHealthError, Health, HealthProblem
from kvcanary.ops.stage_window import WindowStager
from kvcanary.report import CanaryViolationError, Metrics, ReportSink, StepBatch, Violation, WindowReport, decode_rows
from kvcanary.state import CanaryState
from kvcanary.sweep import SweepSlice

logger = logging.getLogger("kvcanary")

_SNAP_COUNTERS = NUM_LAUNCH_TAGS * NUM_COUNTER_COLS


@dataclass
class _Pending:
    """A staged window whose snapshot is in flight to the host (arrived once its buffer's tag reads ``tag``)."""

    index: int
    tag: int
    first_step: int
    last_step: int
    runs: tuple[int, ...]  # the health variants' run counts at staging (Health.runs)
    expected_forwards: int
    sweeps: int


@dataclass
class Snapshot:
    """One staged window as host views (layout: CanaryState.arena without the step); built once per snapshot buffer,
    its views read whatever window the buffer holds."""

    phase: np.ndarray  # [2]
    counters: np.ndarray  # [NUM_LAUNCH_TAGS, NUM_COUNTER_COLS]
    ring: np.ndarray  # [1]: the ring count
    plan_status: np.ndarray  # [groups, NUM_PLAN_STATUS_COLS]
    rows: np.ndarray  # [ring capacity, NUM_VIOLATION_COLS]

    @property
    def ring_total(self) -> int:
        """Rows the kernels tried to keep in the window."""
        return int(self.ring[0])

    @classmethod
    def of(cls, snap: np.ndarray, groups: int) -> Snapshot:
        """Views into a host snapshot (no copies)."""
        o = 2 + _SNAP_COUNTERS
        w = o + 1 + groups * NUM_PLAN_STATUS_COLS
        return cls(snap[0:2], snap[2:o].reshape(NUM_LAUNCH_TAGS, NUM_COUNTER_COLS), snap[o:o + 1],
                   snap[o + 1:w].reshape(groups, NUM_PLAN_STATUS_COLS), snap[w:].reshape(-1, NUM_VIOLATION_COLS))


class Reporter:
    """Stages reporting windows (double-buffered host snapshots; CUDA: an async copy on the forward's stream) and turns
    collected ones into WindowReports for the sinks, the metrics and the health checks."""

    def __init__(self, state: CanaryState, config: CanaryConfig, health: Health, metrics: Metrics,
                 sinks: list[ReportSink], page_size: int) -> None:
        self.state, self.config, self.health, self.metrics, self.sinks = state, config, health, metrics, sinks
        self.page_size = page_size
        self.reports: deque[WindowReport] = deque(maxlen=64)
        self.step_batches: dict[int, StepBatch] = {}
        self.sweep_slices: dict[int, SweepSlice] = {}  # step -> what its sweep verified (names the chains)
        self.window_first = 1
        self.sweeps_staged = 0
        self.violations_total = 0
        self.pending: deque[_Pending] = deque()
        self._next = 0
        self._last_counters = np.zeros((NUM_LAUNCH_TAGS, NUM_COUNTER_COLS), dtype=np.int64)
        d = state.device
        cuda = d.type == "cuda"
        # two snapshot buffers in host memory (CUDA: pinned, written by the staging kernel on the forward's stream),
        # each [tag | snapshot]: stage_window writes the tag last, so a buffer whose tag reads its pending window's has
        # arrived (no event); a buffer is busy while a pending window names it
        self._host = [torch.zeros(1 + state.snapshot.numel(), dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self._tags = [h.numpy()[:1] for h in self._host]
        self._snaps = [Snapshot.of(h.numpy()[1:], len(state.groups)) for h in self._host]
        self._stager = WindowStager(state.window_head, state.sink.count, state.sink.rows, state.reset_span,
                                    self._host, state.backend)
        # The alarm: the ring count (rows emitted since the last staging; it only grows until the next one). CPU: a
        # view of the live count. CUDA: the post stage's last kernel mirrors it into pinned host memory (state.alarm),
        # tagged with the device's post-forward phase, so the host reads it with no copy or event. The staging after
        # forward F resets the count behind forward F's post stage: a mirror tagged <= F holds rows already staged.
        self.stagings = 0
        self._count = state.sink.count.numpy() if d.type != "cuda" else None
        self._alarm = state.alarm.numpy()
        self._staged_at = 0  # the host forward the last staging followed
        # the owner's bookkeeping of a collected window (sweeps completed, metrics, stats line): (report, snapshot,
        # sweeps staged in the window)
        self.on_report: Callable[[WindowReport, Snapshot, int], None] | None = None

    def has_open_window(self, forwards: int) -> bool:
        """Whether forwards or sweeps since the last staging are waiting to be staged."""
        return self.window_first <= forwards or bool(self.sweeps_staged)

    def stage(self, forwards: int) -> None:
        """Snapshot counters, plan status and the kept ring rows of the window into host memory on the forward's stream
        and reset the ring (one ``stage_window``)."""
        k = self._next
        self._next ^= 1
        if any(p.index == k for p in self.pending):  # the buffer's previous window must have been collected
            self.collect(block=True)
        self.stagings += 1
        tag = self.stagings  # fresh per staging: a buffer's old tag never reads as arrived
        self._stager(k, tag)  # in stream order: the snapshot is read before the reset
        self.pending.append(_Pending(k, tag, self.window_first, forwards, self.health.runs(),
                                     self.health.expected_forwards, self.sweeps_staged))
        self.sweeps_staged = 0
        self.window_first = forwards + 1
        self._staged_at = forwards

    def alarmed(self) -> bool:
        """Whether violation rows were emitted since the last staging: CPU as of now, CUDA as of the latest forward
        whose post stage has run (never waits)."""
        if self._count is not None:
            return bool(self._count[0])
        tag = int(self._alarm[0])  # the tag first: the kernel writes it after the count
        return tag > self._staged_at and bool(self._alarm[1])

    def collect(self, block: bool) -> WindowReport | None:
        """Reports of every staged window whose snapshot arrived (all of them when ``block``); the last or None."""
        last = None
        while self.pending:
            p = self.pending[0]
            if self._tags[p.index][0] != p.tag:  # CUDA: not arrived yet (CPU: staged synchronously)
                if not block:
                    break
                if self.state.device.type == "cuda":
                    torch.cuda.synchronize(self.state.device)
                if self._tags[p.index][0] != p.tag:
                    raise KVCanaryInternalError(f"window snapshot {p.tag} did not arrive after a device sync")
            self.pending.popleft()
            last = self._report(p)
        return last

    def _report(self, p: _Pending) -> WindowReport:
        cfg = self.config
        snap = self._snaps[p.index]
        delta = snap.counters - self._last_counters
        self._last_counters = snap.counters.copy()
        viol = delta[:, CounterCol.VIOLATIONS]
        total = int(viol.sum())  # counts only grow: a clean window has no tag to name
        by_tag = {LaunchTag(t): int(viol[t]) for t in np.flatnonzero(viol).tolist()} if total else {}
        self.violations_total += total
        ring_total = snap.ring_total
        kept_n = min(ring_total, cfg.ring_capacity)
        rows = decode_rows(torch.from_numpy(snap.rows[:kept_n].copy()), self.step_batches, self.sweep_slices) \
            if kept_n else []
        report = WindowReport(p.first_step, p.last_step, rows, total, ring_total,
                              max(0, ring_total - cfg.ring_capacity), by_tag, torch.from_numpy(delta),
                              self._quarantine(rows) if rows else (), self.page_size)
        self._forget(p.first_step, p.last_step)
        problems = self.health.check(snap.counters, snap.phase, snap.plan_status, report.dropped, cfg.ring_capacity,
                                     p.runs, p.expected_forwards)
        if self.on_report is not None:
            self.on_report(report, snap, p.sweeps)
        self.reports.append(report)
        self._dispatch(report, problems)
        return report

    def _forget(self, first: int, last: int) -> None:
        """Drop the attribution data of steps up to ``last`` (reported)."""
        for s in range(first, last + 1):
            self.step_batches.pop(s, None)
        if self.sweep_slices:
            for s in [s for s in self.sweep_slices if s <= last]:
                del self.sweep_slices[s]

    def prune(self) -> None:
        """Drop step batches older than two reporting windows (forwards whose rows can no longer come back)."""
        horizon = self.window_first - 2 * self.config.report_interval
        for s in [s for s in self.step_batches if s < horizon]:
            del self.step_batches[s]

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

    def _dispatch(self, report: WindowReport, problems: list[HealthProblem]) -> None:
        raising = self.config.mode == CanaryMode.RAISE
        for sink in self.sinks if report.total else (s for s in self.sinks if s is self.metrics):  # clean: metrics only
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
