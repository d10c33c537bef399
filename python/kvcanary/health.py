"""Health: per-tag kernel-run watchdog, phase check, overflow warnings and a periodic coverage stats line."""

from __future__ import annotations

import logging
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch
from kvcanary_schema import NUM_COUNTER_COLS, NUM_LAUNCH_TAGS, CounterCol, LaunchTag, PlanStatusCol

from kvcanary.errors import KVCanaryError

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

    def observe(self, request: Hashable, prefix_len: int, newly_verified: int) -> None:
        """Account one forward of one request (``newly_verified``: distinct older slots this forward reached)."""
        self.live[request] = prefix_len
        self.verified[request] = min(prefix_len, self.verified.get(request, 0) + newly_verified)

    def fraction(self) -> float:
        """Fraction of live slots verified at least once in the window (1.0 when nothing is live)."""
        live = sum(self.live.values())
        return 1.0 if live == 0 else sum(self.verified.values()) / live


class Health:
    """Compares staged device counters with what the host launched; tracks coverage for the stats line."""

    def __init__(self, stats_interval: int, watchdog: bool = True) -> None:
        self.expected = torch.zeros(NUM_LAUNCH_TAGS, 2, dtype=torch.int64)  # [tag, (VERIFY_RUNS, WRITE_RUNS)]
        self.expected_forwards = 0
        self.stats_interval = stats_interval
        self.watchdog = watchdog
        self.coverage = Coverage()
        self.last_counters = torch.zeros(NUM_LAUNCH_TAGS, NUM_COUNTER_COLS, dtype=torch.int64)
        self.stats_counters = torch.zeros(NUM_LAUNCH_TAGS, NUM_COUNTER_COLS, dtype=torch.int64)
        self.problems: list[HealthProblem] = []
        self.last_stats_line: str | None = None

    def expect(self, tag: int, verify_runs: int = 0, write_runs: int = 0) -> None:
        """Record launches the host issued (or that a replayed graph must have run)."""
        self.expected[tag, 0] += verify_runs
        self.expected[tag, 1] += write_runs

    def expect_all(self, runs: torch.Tensor) -> None:
        """Add a whole [NUM_LAUNCH_TAGS, 2] table of (verify, write) launches (one forward's)."""
        self.expected += runs

    def check(self, counters: list[list[int]], phase: list[int], plan_status: list[list[int]], dropped: int,
              capacity: int) -> list[HealthProblem]:
        """Check one staged snapshot (host values) against the expectations at staging time."""
        found: list[HealthProblem] = []
        if self.watchdog:
            runs = [[row[CounterCol.VERIFY_RUNS], row[CounterCol.WRITE_RUNS]] for row in counters]
            want = self.expected.tolist()
            short = [t for t in range(NUM_LAUNCH_TAGS) if runs[t][0] < want[t][0] or runs[t][1] < want[t][1]]
            if short:
                names = [LaunchTag(t).name for t in short]
                found.append(HealthProblem("watchdog", (
                    f"kvcanary: kernel runs behind for tags {names}: device verify/write runs "
                    f"{[runs[t] for t in short]} < launched {[want[t] for t in short]}; a canary launch was skipped")))
            p0, p1 = phase
            if (p0, p1) != (self.expected_forwards, self.expected_forwards):
                found.append(HealthProblem("phase", (
                    f"kvcanary: phase check failed: pre={p0} post={p1} device brackets, {self.expected_forwards} "
                    f"forwards on the host; a forward (or a replayed graph) ran without the canary ops")))
        status = plan_status
        if max(row[PlanStatusCol.OVERFLOW] for row in status) > 0:
            found.append(HealthProblem("overflow", (
                "kvcanary: a batch claimed more tokens than it has (plan OVERFLOW); those requests were not checked")))
        errs = max(row[PlanStatusCol.INPUT_ERRORS] for row in status)
        if errs:
            found.append(HealthProblem("input_errors", f"kvcanary: {errs} request(s) with out-of-range batch values "
                                                       "were skipped by the plan"))
        if dropped:
            found.append(HealthProblem("ring_drops", (
                f"kvcanary: violation ring overflowed: {dropped} rows beyond capacity {capacity} were counted but not "
                "kept (raise ring_capacity for more detail)")))
        self.problems.extend(found)
        return found

    def stats(self, step: int, counters: list[list[int]], sweeps_completed: int, violations_total: int) -> str | None:
        """The periodic stats line (coverage over the window, not a running sum), or None when not due."""
        if self.stats_interval == 0 or step % self.stats_interval != 0:
            return None
        now = torch.tensor(counters, dtype=torch.int64)
        delta = now - self.stats_counters
        self.stats_counters = now
        checked = int(delta[:, CounterCol.ENTRIES_CHECKED].sum())
        written = int(delta[:, CounterCol.ENTRIES_WRITTEN].sum())
        active = int((delta[:, CounterCol.VERIFY_RUNS] + delta[:, CounterCol.WRITE_RUNS] > 0).sum())
        line = (f"kvcanary stats: step={step} coverage={self.coverage.fraction():.3f} "
                f"live_slots={sum(self.coverage.live.values())} checked={checked} written={written} "
                f"violations={int(delta[:, CounterCol.VIOLATIONS].sum())} (total {violations_total}) "
                f"input_errors={int(delta[:, CounterCol.INPUT_ERRORS].sum())} "
                f"skipped={int(delta[:, CounterCol.SKIPPED].sum())} sweeps_completed={sweeps_completed} "
                f"tags_active={active}/{NUM_LAUNCH_TAGS}")
        self.coverage = Coverage()
        self.last_stats_line = line
        return line
