"""Health: the watchdog trips on a skipped launch, the phase check, LOG never raises, coverage stats line."""

from __future__ import annotations

import logging
from typing import Any

import kvcanary.program as program_mod
import pytest
import torch
from kvcanary.health import CanaryHealthError
from kvcanary.manager import CanaryManager
from kvcanary_schema import Stage

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
