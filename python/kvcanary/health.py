"""Health: per-tag kernel-run watchdog, phase check, overflow warnings and a periodic coverage stats line."""

from __future__ import annotations

import logging
from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np
from kvcanary_schema import NUM_COUNTER_COLS, NUM_LAUNCH_TAGS, CounterCol, LaunchTag, PlanStatusCol

from kvcanary.errors import KVCanaryError
from kvcanary.rows import RequestRows

logger = logging.getLogger("kvcanary")


class CanaryHealthError(KVCanaryError, RuntimeError):
    """RAISE mode: the canary is not running as installed (skipped launch, graph without canary ops)."""


@dataclass
class HealthProblem:
    """One health finding."""

    kind: str  # "watchdog", "phase", "overflow", "input_errors", "ring_drops"
    message: str


@dataclass
class Coverage:
    """Per stats window: live prefix slots of the requests seen, and how many of them were verified."""

    live: dict[Hashable, int] = field(default_factory=dict)  # request -> prefix length at its last forward
    verified: dict[Hashable, int] = field(default_factory=dict)  # request -> distinct prefix slots verified
    # FULL policy: every row that ran after forward `since` had its whole prefix verified (kept per row, not observed
    # per request)
    rows: RequestRows | None = None
    since: int = 0

    def observe(self, request: Hashable, prefix_len: int, newly_verified: int) -> None:
        """Account one forward of one request (``newly_verified``: distinct older slots this forward reached)."""
        self.live[request] = prefix_len
        self.verified[request] = min(prefix_len, self.verified.get(request, 0) + newly_verified)

    def live_slots(self) -> int:
        """Live prefix slots of the window."""
        return sum(self.live.values()) + self._whole()

    def fraction(self) -> float:
        """Fraction of live slots verified at least once in the window (1.0 when nothing is live)."""
        whole = self._whole()
        live = sum(self.live.values()) + whole
        return 1.0 if live == 0 else (sum(self.verified.values()) + whole) / live

    def next_window(self, step: int) -> Coverage:
        """An empty window after forward ``step``."""
        return Coverage(rows=self.rows, since=step)

    def _whole(self) -> int:
        return 0 if self.rows is None else self.rows.live_slots(self.since)


class Health:
    """Compares staged device counters with what the host launched; tracks coverage for the stats line."""

    def __init__(self, stats_interval: int, watchdog: bool = True) -> None:
        self._expected = np.zeros((NUM_LAUNCH_TAGS, 2), dtype=np.int64)  # [tag, (VERIFY_RUNS, WRITE_RUNS)]
        self.expected_forwards = 0
        # per forward variant (:meth:`add_variant`): its launch table and the forwards not yet folded into _expected
        self._variants: list[np.ndarray] = []
        self._unfolded: list[int] = []
        self.stats_interval = stats_interval
        self.watchdog = watchdog
        self.coverage = Coverage()
        self.stats_counters = np.zeros((NUM_LAUNCH_TAGS, NUM_COUNTER_COLS), dtype=np.int64)
        self.problems: list[HealthProblem] = []
        self.last_stats_line: str | None = None
        self._stats_step = 0  # last step of the window that printed the last stats line

    @property
    def expected(self) -> np.ndarray:
        """[NUM_LAUNCH_TAGS, 2]: the (verify, write) launches expected so far, every counted forward included."""
        for v, n in enumerate(self._unfolded):
            if n:
                self._expected += self._variants[v] * n
                self._unfolded[v] = 0
        return self._expected

    def add_variant(self, runs: np.ndarray) -> int:
        """Register a [NUM_LAUNCH_TAGS, 2] table of (verify, write) launches the host issues together (one forward's,
        one sweep chunk's); returns its variant id for :meth:`expect_forward` and :meth:`expect_runs`."""
        self._variants.append(runs)
        self._unfolded.append(0)
        return len(self._variants) - 1

    def expect_runs(self, variant: int, times: int = 1) -> None:
        """A registered variant's launches ran ``times`` times (its table is added when :attr:`expected` is read)."""
        self._unfolded[variant] += times

    def expect_forward(self, variant: int) -> None:
        """One forward of a registered variant ran."""
        self._unfolded[variant] += 1
        self.expected_forwards += 1

    def check(self, counters: np.ndarray, phase: np.ndarray, plan_status: np.ndarray, dropped: int, capacity: int,
              expected: np.ndarray, expected_forwards: int) -> list[HealthProblem]:
        """Check one staged snapshot (host int64 arrays) against the expectations at staging time."""
        found: list[HealthProblem] = []
        if self.watchdog:
            found += _watchdog(counters, expected) + _phase(phase, expected_forwards)
        if plan_status[:, PlanStatusCol.OVERFLOW].max() > 0:
            found.append(HealthProblem("overflow", (
                "kvcanary: a batch claimed more tokens than it has (plan OVERFLOW); those requests were not checked")))
        errs = int(plan_status[:, PlanStatusCol.INPUT_ERRORS].max())
        if errs:
            found.append(HealthProblem("input_errors", f"kvcanary: {errs} request(s) with out-of-range batch values "
                                                       "were skipped by the plan"))
        if dropped:
            found.append(HealthProblem("ring_drops", (
                f"kvcanary: violation ring overflowed: {dropped} rows beyond capacity {capacity} were counted but not "
                "kept (raise ring_capacity for more detail)")))
        self.problems.extend(found)
        return found

    def stats(self, step: int, counters: np.ndarray, sweeps_completed: int, violations_total: int) -> str | None:
        """The periodic stats line (coverage over the window, not a running sum), or None when not due: due for the
        first reporting window that ends at or past each multiple of ``stats_interval`` (windows of several forwards
        rarely end on one)."""
        iv = self.stats_interval
        if iv == 0 or step // iv == self._stats_step // iv:
            return None
        self._stats_step = step
        delta = counters - self.stats_counters
        self.stats_counters = counters.copy()
        checked = int(delta[:, CounterCol.ENTRIES_CHECKED].sum())
        written = int(delta[:, CounterCol.ENTRIES_WRITTEN].sum())
        active = int((delta[:, CounterCol.VERIFY_RUNS] + delta[:, CounterCol.WRITE_RUNS] > 0).sum())
        line = (f"kvcanary stats: step={step} coverage={self.coverage.fraction():.3f} "
                f"live_slots={self.coverage.live_slots()} checked={checked} written={written} "
                f"violations={int(delta[:, CounterCol.VIOLATIONS].sum())} (total {violations_total}) "
                f"input_errors={int(delta[:, CounterCol.INPUT_ERRORS].sum())} "
                f"skipped={int(delta[:, CounterCol.SKIPPED].sum())} sweeps_completed={sweeps_completed} "
                f"tags_active={active}/{NUM_LAUNCH_TAGS}")
        self.coverage = self.coverage.next_window(step)
        self.last_stats_line = line
        return line


def _watchdog(counters: np.ndarray, expected: np.ndarray) -> list[HealthProblem]:
    behind = (counters[:, CounterCol.VERIFY_RUNS] < expected[:, 0]) | \
        (counters[:, CounterCol.WRITE_RUNS] < expected[:, 1])
    if not behind.any():
        return []
    runs = counters[:, [CounterCol.VERIFY_RUNS, CounterCol.WRITE_RUNS]]
    short = np.flatnonzero(behind).tolist()
    names = [LaunchTag(t).name for t in short]
    return [HealthProblem("watchdog", (
        f"kvcanary: kernel runs behind for tags {names}: device verify/write runs "
        f"{runs[short].tolist()} < launched {expected[short].tolist()}; a canary launch was skipped"))]


def _phase(phase: np.ndarray, forwards: int) -> list[HealthProblem]:
    p0, p1 = int(phase[0]), int(phase[1])
    if (p0, p1) == (forwards, forwards):
        return []
    return [HealthProblem("phase", (
        f"kvcanary: phase check failed: pre={p0} post={p1} device brackets, {forwards} "
        f"forwards on the host; a forward (or a replayed graph) ran without the canary ops"))]
