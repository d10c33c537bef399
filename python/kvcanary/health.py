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

    def totals(self) -> tuple[int, int]:
        """(live prefix slots, those verified at least once) of the window."""
        whole = self._whole()
        return sum(self.live.values()) + whole, sum(self.verified.values()) + whole

    def next_window(self, step: int) -> Coverage:
        """An empty window after forward ``step``."""
        return Coverage(rows=self.rows, since=step)

    def _whole(self) -> int:
        return 0 if self.rows is None else self.rows.live_slots(self.since)


class Health:
    """Compares staged device counters with what the host launched; tracks coverage for the stats line."""

    def __init__(self, stats_interval: int, watchdog: bool = True) -> None:
        self.expected_forwards = 0
        # per registered variant (:meth:`add_variant`): its launch table as one row of _tables ([variants, tags * 2]),
        # and how many times it ran (Python ints: a forward adds one, no array work until a window is checked)
        self._tables = np.zeros((0, NUM_LAUNCH_TAGS * 2), dtype=np.int64)
        self._runs: list[int] = []
        self.stats_interval = stats_interval
        self.watchdog = watchdog
        self.coverage = Coverage()
        self.stats_counters = np.zeros((NUM_LAUNCH_TAGS, NUM_COUNTER_COLS), dtype=np.int64)
        self.problems: list[HealthProblem] = []
        self.last_stats_line: str | None = None
        self._stats_step = 0  # last step of the window that printed the last stats line

    def runs(self) -> tuple[int, ...]:
        """How many times each registered variant ran so far (what :meth:`expected_of` turns into launches)."""
        return tuple(self._runs)

    def expected_of(self, runs: tuple[int, ...]) -> np.ndarray:
        """[NUM_LAUNCH_TAGS, 2]: the (verify, write) launches of the registered variants run ``runs`` times each."""
        return (np.array(runs, dtype=np.int64) @ self._tables[:len(runs)]).reshape(NUM_LAUNCH_TAGS, 2)

    def add_variant(self, runs: np.ndarray) -> int:
        """Register a [NUM_LAUNCH_TAGS, 2] table of (verify, write) launches the host issues together (one forward's,
        one sweep chunk's); returns its variant id for :meth:`expect_forward` and :meth:`expect_runs`."""
        self._tables = np.concatenate([self._tables, np.asarray(runs, dtype=np.int64).reshape(1, -1)])
        self._runs.append(0)
        return len(self._runs) - 1

    def expect_runs(self, variant: int, times: int = 1) -> None:
        """A registered variant's launches ran ``times`` times."""
        self._runs[variant] += times

    def expect_forward(self, variant: int) -> None:
        """One forward of a registered variant ran."""
        self._runs[variant] += 1
        self.expected_forwards += 1

    def check(self, counters: np.ndarray, phase: np.ndarray, plan_status: np.ndarray, dropped: int, capacity: int,
              runs: tuple[int, ...], expected_forwards: int) -> list[HealthProblem]:
        """Check one staged snapshot (host int64 arrays) against the expectations at staging time (``runs``: the
        variants' run counts then, from :meth:`runs`)."""
        found: list[HealthProblem] = []
        if self.watchdog:
            found += _watchdog(counters, self.expected_of(runs)) + _phase(phase, expected_forwards)
        overflow, errs = plan_status[:, [PlanStatusCol.OVERFLOW, PlanStatusCol.INPUT_ERRORS]].max(0).tolist()
        if overflow > 0:
            found.append(HealthProblem("overflow", (
                "kvcanary: a batch claimed more tokens than it has (plan OVERFLOW); those requests were not checked")))
        if errs:
            found.append(HealthProblem("input_errors", f"kvcanary: {errs} request(s) with out-of-range batch values "
                                                       "were skipped by the plan"))
        if dropped:
            found.append(HealthProblem("ring_drops", (
                f"kvcanary: violation ring overflowed: {dropped} rows beyond capacity {capacity} were counted but not "
                "kept (raise ring_capacity for more detail)")))
        self.problems.extend(found)
        return found

    def window(self, step: int, counters: np.ndarray, sweeps_completed: int,
               violations_total: int) -> tuple[float, str | None]:
        """A collected window ending at forward ``step``: the fraction of live slots verified at least once so far in
        the stats window (1.0 when nothing is live), and the periodic stats line (coverage over the stats window, not
        a running sum), or None when not due: due for the first reporting window that ends at or past each multiple
        of ``stats_interval`` (windows of several forwards rarely end on one)."""
        live, verified = self.coverage.totals()
        fraction = 1.0 if live == 0 else verified / live
        iv = self.stats_interval
        if iv == 0 or step // iv == self._stats_step // iv:
            return fraction, None
        self._stats_step = step
        delta = counters - self.stats_counters
        self.stats_counters = counters.copy()
        sums = delta.sum(0).tolist()
        active = int(np.count_nonzero(delta[:, CounterCol.VERIFY_RUNS] + delta[:, CounterCol.WRITE_RUNS] > 0))
        line = (f"kvcanary stats: step={step} coverage={fraction:.3f} live_slots={live} "
                f"checked={sums[CounterCol.ENTRIES_CHECKED]} written={sums[CounterCol.ENTRIES_WRITTEN]} "
                f"violations={sums[CounterCol.VIOLATIONS]} (total {violations_total}) "
                f"input_errors={sums[CounterCol.INPUT_ERRORS]} skipped={sums[CounterCol.SKIPPED]} "
                f"sweeps_completed={sweeps_completed} tags_active={active}/{NUM_LAUNCH_TAGS}")
        self.coverage = self.coverage.next_window(step)
        self.last_stats_line = line
        return fraction, line


def _watchdog(counters: np.ndarray, expected: np.ndarray) -> list[HealthProblem]:
    runs = counters[:, [CounterCol.VERIFY_RUNS, CounterCol.WRITE_RUNS]]
    behind = runs < expected
    if not behind.any():
        return []
    short = np.flatnonzero(behind.any(1)).tolist()
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
