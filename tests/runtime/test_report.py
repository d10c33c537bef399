"""Reporting: LOG vs RAISE, nothing lost across ring overflow in two windows, sinks, metrics."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from kvcanary.errors import KVCanaryInternalError
from kvcanary.report import CanaryViolationError, WindowReport
from kvcanary_schema import FailReason, LaunchTag, RecordField

from .fake_engine import FakeEngine
from .helpers import run, setup, step


def _flip_prefix(eng: FakeEngine, m: object, rid: str, n: int | None = None) -> torch.Tensor:
    """Flip prev_hash of the TAIL K records of a request's prefix (not its last slot); returns the slots."""
    r = eng.reqs[rid]
    idx = list(range(r.kv_len - 1))[:n]
    slots = eng.req_to_token[r.row, idx].long()
    _flip(m, slots)
    return slots


def _flip(m: object, slots: torch.Tensor) -> None:
    m.state.groups[0].tail.records[slots, 0, RecordField.PREV_HASH] ^= 1  # type: ignore[attr-defined]


def _overflow_scenario(ring: int) -> list[WindowReport]:
    eng, m = setup(n_reqs=3, prompt_len=10, ring_capacity=ring, report_interval=1)  # a window per forward
    run(eng, m, 1)
    out = []
    flipped = _flip_prefix(eng, m, "r0")
    out.append(step(eng, m))
    _flip(m, flipped)  # restore
    out.append(step(eng, m))
    _flip_prefix(eng, m, "r1")
    out.append(step(eng, m))
    return out  # type: ignore[return-value]


def test_nothing_lost_across_overflow_in_two_windows() -> None:
    small, big = _overflow_scenario(4), _overflow_scenario(4096)
    for s, b in zip(small, big, strict=True):
        assert s.total == b.total  # exact totals regardless of the ring
        assert s.ring_total == b.total
        assert len(s.violations) == min(4, b.total)
        assert s.dropped == max(0, b.total - 4)
        kept = {(v.tag, v.slot, int(v.reasons)) for v in b.violations}
        assert {(v.tag, v.slot, int(v.reasons)) for v in s.violations} <= kept
    assert small[0].total > 4 and small[0].dropped > 0
    assert small[1].total == 0
    assert small[2].total > 4 and len(small[2].violations) == 4  # the later window is captured again
    assert small[2].request_ids == ["r1"] and small[0].request_ids == ["r0"]


def test_raise_mode_carries_rows_and_requests() -> None:
    eng, m = setup(n_reqs=2, mode="raise")
    run(eng, m, 1)
    _flip_prefix(eng, m, "r1", 1)
    with pytest.raises(CanaryViolationError) as ei:
        step(eng, m)
    err = ei.value
    assert err.request_ids == ["r1"]
    assert err.violations and all(v.tag == LaunchTag.TAIL_K_FULL for v in err.violations)
    assert all(v.reasons & FailReason.VERIFY_CHAIN for v in err.violations)
    assert "r1" in str(err)


def test_log_mode_never_raises_rate_limits_and_dedups(caplog: pytest.LogCaptureFixture) -> None:
    eng, m = setup(n_reqs=3, prompt_len=10, log_rate_limit=2)
    run(eng, m, 1)
    _flip_prefix(eng, m, "r0")
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        r1 = step(eng, m)
        lines1 = [rec.message for rec in caplog.records if rec.message.startswith("kvcanary violation:")]
        caplog.clear()
        r2 = step(eng, m)  # the same slots fail again: deduplicated
        lines2 = [rec.message for rec in caplog.records if rec.message.startswith("kvcanary violation:")]
        summaries = [rec.message for rec in caplog.records if "kvcanary window" in rec.message]
    assert r1 is not None and r1.total > 2 and len(lines1) == 2
    assert r2 is not None and r2.total > 0 and lines2 == [] and summaries


def test_jsonl_callback_and_metrics(tmp_path: Path) -> None:
    path = tmp_path / "v.jsonl"
    got: list[WindowReport] = []
    eng, m = setup(n_reqs=2, jsonl_path=str(path))
    from kvcanary.report import CallbackSink
    m.add_sink(CallbackSink(got.append))
    run(eng, m, 1)
    _flip_prefix(eng, m, "r0", 2)
    rep = step(eng, m)
    assert rep is not None and got == [rep]
    objs = [json.loads(line) for line in path.read_text().splitlines()]
    assert [o["type"] for o in objs].count("violation") == len(rep.violations)
    assert objs[-1]["type"] == "window" and objs[-1]["total"] == rep.total
    assert objs[0]["request_id"] == "r0" and objs[0]["tag"] == "TAIL_K_FULL"
    text = m.metrics.render()
    assert f'kvcanary_violations_total{{tag="TAIL_K_FULL"}} {rep.by_tag[LaunchTag.TAIL_K_FULL]}' in text
    assert 'kvcanary_violation_rows_total{reason="verify_chain"}' in text
    assert "kvcanary_coverage 1.000000" in text


def test_report_interval_groups_forwards() -> None:
    eng, m = setup(n_reqs=2, report_interval=3)
    reports = run(eng, m, 6)
    assert [(r.first_step, r.last_step) for r in reports] == [(1, 3), (4, 6)]


def test_clean_forwards_stage_one_window_per_report_interval() -> None:
    eng, m = setup(n_reqs=2, report_interval=16)
    got = [step(eng, m) for _ in range(40)]
    windows = [(r.first_step, r.last_step) for r in got if r is not None]
    assert windows == [(1, 16), (17, 32)]  # floor(40 / 16) clean windows, each returned by the forward ending it
    assert [i + 1 for i, r in enumerate(got) if r is not None] == [16, 32]
    assert m.reporter.stagings == 2 and not m.health.problems
    last = m.flush()
    assert last is not None and (last.first_step, last.last_step, last.total) == (33, 40, 0)


def test_a_snapshot_whose_tag_never_arrives_is_an_internal_error() -> None:
    """A window is taken as arrived only when its buffer's tag reads the one it was staged with: a staging that wrote
    the snapshot but not the tag is never reported as a (clean) window."""
    eng, m = setup(n_reqs=2, report_interval=2)
    stager = m.reporter._stager
    m.reporter._stager = lambda k, tag: stager(k, tag - 1000)  # type: ignore[method-assign]
    assert step(eng, m) is None
    with pytest.raises(KVCanaryInternalError, match="did not arrive"):
        step(eng, m)  # ends the window: on the CPU its end_forward collects it, blocking
    assert len(m.reports) == 0


def test_violation_is_reported_by_the_violating_forward() -> None:
    eng, m = setup(n_reqs=3, prompt_len=10)  # the default report_interval: forward 6 is mid-window
    assert all(step(eng, m) is None for _ in range(5))
    _flip_prefix(eng, m, "r1", 2)
    rep = step(eng, m)
    assert rep is not None and (rep.first_step, rep.last_step) == (1, 6)
    assert rep.total > 0 and rep.request_ids == ["r1"]
    assert {v.step for v in rep.violations} == {6}
    assert m.reporter.stagings == 1


def test_raise_mode_raises_in_the_violating_forward() -> None:
    eng, m = setup(n_reqs=2, mode="raise")
    for _ in range(3):
        step(eng, m)
    _flip_prefix(eng, m, "r0", 1)
    with pytest.raises(CanaryViolationError) as ei:
        step(eng, m)
    assert ei.value.report.last_step == m.forwards == 4
    assert ei.value.request_ids == ["r0"]


def _streak(ring: int, report_interval: int) -> list[WindowReport]:
    """Violations in forwards 3, 4 and 5 (r0's prefix stays bad, r1's joins in 4, r2's in 5), then clean ones."""
    eng, m = setup(n_reqs=3, prompt_len=10, ring_capacity=ring, report_interval=report_interval)
    out = [step(eng, m) for _ in range(2)]
    flipped = [_flip_prefix(eng, m, "r0")]
    out.append(step(eng, m))
    flipped.append(_flip_prefix(eng, m, "r1"))
    out.append(step(eng, m))
    flipped.append(_flip_prefix(eng, m, "r2"))
    out.append(step(eng, m))
    for slots in flipped:
        _flip(m, slots)  # restore
    out += [step(eng, m) for _ in range(3)]
    out.append(m.flush())
    return [r for r in out if r is not None]


@pytest.mark.parametrize("ring", [4, 4096])
def test_no_rows_lost_in_consecutive_violating_forwards(ring: int) -> None:
    per_forward = {r.last_step: r for r in _streak(4096, 1)}
    windows = _streak(ring, 16)
    bad = [r for r in windows if r.total]
    assert [(r.first_step, r.last_step) for r in bad] == [(1, 3), (4, 4), (5, 5)]  # one window per violating forward
    for r in bad:
        want = per_forward[r.last_step]
        assert want.total > 4 and r.total == r.ring_total == want.total
        assert len(r.violations) == min(ring, want.total)
        assert r.dropped == max(0, want.total - ring)
        assert {v.key() for v in r.violations} <= {v.key() for v in want.violations}
        assert set(r.request_ids) <= set(want.request_ids)
    assert sum(r.total for r in windows) == sum(r.total for r in per_forward.values())
    assert [(r.first_step, r.last_step) for r in windows if not r.total] == [(6, 8)]  # the flush


def test_prune_keeps_every_step_of_an_unreported_window() -> None:
    eng, m = setup(n_reqs=2, report_interval=16)
    for _ in range(40):
        step(eng, m)
    m.reporter.prune()
    assert set(range(33, 41)) <= set(m.reporter.step_batches)  # the open window (33..40)
    _flip_prefix(eng, m, "r1", 1)
    rep = step(eng, m)
    assert rep is not None and rep.request_ids == ["r1"] and (rep.first_step, rep.last_step) == (33, 41)
