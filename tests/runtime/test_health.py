"""Health: the watchdog trips on a skipped launch, the phase check, LOG never raises, coverage stats line."""

from __future__ import annotations

import logging
from typing import Any

import kvcanary.program as program_mod
import numpy as np
import pytest
import torch
from kvcanary.health import CanaryHealthError, Health
from kvcanary.manager import CanaryManager
from kvcanary_schema import NUM_COUNTER_COLS, NUM_LAUNCH_TAGS, NUM_PLAN_STATUS_COLS, CounterCol, Stage

from .helpers import bracket, run, setup, step


def _skip_tail_verify_once(monkeypatch: pytest.MonkeyPatch, m: CanaryManager) -> None:
    """The next TAIL verify the device program runs is skipped (as if a launch had been lost)."""
    real = program_mod.bind_verify
    state = {"skipped": False}

    def flaky(group: Any, stage: Stage, *a: Any, **k: Any) -> Any:
        op = real(group, stage, *a, **k)
        if stage != Stage.TAIL:
            return op

        class RunOnceSkipped:  # a plain step of the program: it runs alone, between the native sequences
            def frozen(self) -> RunOnceSkipped:
                return self

            def __call__(self, table: torch.Tensor, rows: int, tokens: int) -> None:
                if not state["skipped"]:
                    state["skipped"] = True
                    return
                op(table, rows, tokens)
        return RunOnceSkipped()
    monkeypatch.setattr(program_mod, "bind_verify", flaky)
    m.program._stages = None  # bind the program again, with the flaky verify


def test_watchdog_trips_when_a_launch_is_skipped_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    eng, m = setup(n_reqs=2, mode="raise")
    run(eng, m, 2)
    _skip_tail_verify_once(monkeypatch, m)
    with pytest.raises(CanaryHealthError, match="TAIL_K_FULL"):  # at the end of the (clean) window
        step(eng, m)
        m.flush()


def test_watchdog_log_mode_warns_only(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    eng, m = setup(n_reqs=2, mode="log")
    run(eng, m, 1)
    _skip_tail_verify_once(monkeypatch, m)
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        step(eng, m)
        m.flush()
    assert [p.kind for p in m.health.problems] == ["watchdog"]
    assert any("launch was skipped" in r.message for r in caplog.records)


def test_watchdog_quiet_on_clean_runs_with_sweeps() -> None:
    eng, m = setup(n_reqs=2, mode="raise", sweep_interval=2, fingerprint="all", coverage="window", stripe_size=2)
    run(eng, m, 6)
    assert not m.health.problems


def test_phase_check_detects_forward_without_canary_ops() -> None:
    eng, m = setup(n_reqs=1, mode="raise")
    run(eng, m, 1)
    m.state.phase[1] -= 1  # as if a replayed graph had lacked the post-forward canary ops
    with pytest.raises(CanaryHealthError, match="phase check"):
        step(eng, m)
        m.flush()


def test_stats_line_reports_coverage(caplog: pytest.LogCaptureFixture) -> None:
    eng, m = setup(n_reqs=2, prompt_len=20, stats_interval=2, report_interval=2, coverage="window", stripe_size=2,
                   window_links=1)
    with caplog.at_level(logging.INFO, logger="kvcanary"):
        run(eng, m, 4)
    lines = [r.message for r in caplog.records if r.message.startswith("kvcanary stats:")]
    assert len(lines) == 2
    cov = float(lines[-1].split("coverage=")[1].split()[0])
    assert 0.0 < cov < 1.0  # window policy: part of the live slots per stats window
    eng2, m2 = setup(n_reqs=2, prompt_len=20, stats_interval=2, report_interval=2)
    with caplog.at_level(logging.INFO, logger="kvcanary"):
        caplog.clear()
        run(eng2, m2, 2)
    assert "coverage=1.000" in [r.message for r in caplog.records if r.message.startswith("kvcanary stats:")][0]


def test_overflow_and_input_errors_reported() -> None:
    eng, m = setup(n_reqs=2)
    run(eng, m, 1)
    b = eng.batch()
    b.prefix_lens[0] = -5  # a data-dependent bad value: counted by the plan, never raised before launch
    bracket(eng, m, b)
    m.flush()
    assert "input_errors" in [p.kind for p in m.health.problems]


def test_stats_line_when_a_window_passes_a_multiple(caplog: pytest.LogCaptureFixture) -> None:
    """Windows of 4 forwards never end on a multiple of 5: a line for each window that passes one."""
    eng, m = setup(n_reqs=2, stats_interval=5, report_interval=4)
    with caplog.at_level(logging.INFO, logger="kvcanary"):
        run(eng, m, 12)
    lines = [r.message for r in caplog.records if r.message.startswith("kvcanary stats:")]
    assert [int(line.split("step=")[1].split()[0]) for line in lines] == [8, 12]


def test_window_stats_line_and_watchdog_by_hand() -> None:
    """Health alone on hand-made counters: the stats line's sums over the stats window, its coverage, and the watchdog
    against the registered variants' launches times their run counts."""
    h = Health(stats_interval=10)
    one, two = np.zeros((NUM_LAUNCH_TAGS, 2), dtype=np.int64), np.zeros((NUM_LAUNCH_TAGS, 2), dtype=np.int64)
    one[0] = (1, 1)
    two[0, 0], two[3, 1] = 2, 1
    v1, v2 = h.add_variant(one), h.add_variant(two)
    for _ in range(3):
        h.expect_forward(v1)
    h.expect_runs(v2, 2)
    runs = h.runs()
    assert runs == (3, 2) and h.expected_of(runs)[[0, 3]].tolist() == [[7, 3], [0, 2]]
    counters = np.zeros((NUM_LAUNCH_TAGS, NUM_COUNTER_COLS), dtype=np.int64)
    counters[0, [CounterCol.VERIFY_RUNS, CounterCol.WRITE_RUNS]] = (7, 3)
    counters[3, CounterCol.WRITE_RUNS] = 2
    counters[0, CounterCol.ENTRIES_CHECKED:] = (11, 5, 1, 2, 4)
    counters[3, CounterCol.ENTRIES_CHECKED:] = (20, 0, 0, 1, 0)
    phase, plan = np.array([3, 3]), np.zeros((1, NUM_PLAN_STATUS_COLS), dtype=np.int64)
    assert h.check(counters, phase, plan, 0, 8, runs, 3) == []
    counters[3, CounterCol.WRITE_RUNS] = 1
    found = h.check(counters, phase, plan, 0, 8, runs, 3)
    assert [p.kind for p in found] == ["watchdog"] and "[[0, 1]] < launched [[0, 2]]" in found[0].message
    h.coverage.observe("a", 8, 6)
    h.coverage.observe("b", 4, 3)
    assert h.window(9, counters, 0, 0) == (0.75, None)  # not due before step 10
    frac, line = h.window(12, counters, 2, 5)
    assert frac == 0.75 and line == (f"kvcanary stats: step=12 coverage=0.750 live_slots=12 checked=31 written=5 "
                                     f"violations=1 (total 5) input_errors=3 skipped=4 sweeps_completed=2 "
                                     f"tags_active=2/{NUM_LAUNCH_TAGS}")
    counters[0, CounterCol.ENTRIES_CHECKED] += 4
    assert h.window(20, counters, 2, 5)[1] == (f"kvcanary stats: step=20 coverage=1.000 live_slots=0 checked=4 "
                                               "written=0 violations=0 (total 5) input_errors=0 skipped=0 "
                                               f"sweeps_completed=2 tags_active=0/{NUM_LAUNCH_TAGS}")
