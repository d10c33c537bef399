"""The structural write check with the default CanaryConfig on the reference engine: misplaced writes are reported
in the forward where they happen, with the row, the position and both slots, in the log, JSONL and RAISE."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest
from kvcanary import campaign as C
from kvcanary.config import CanaryConfig, CanaryMode
from kvcanary.engine import Engine, FaultConfig, ForwardBatch, PoolKind
from kvcanary.engine.canary import EngineCanary
from kvcanary.report import CanaryViolationError, Violation
from kvcanary_schema import NO_SLOT, FailReason, LaunchTag, Stage


class _FireLog:
    """After every bracket: the canary forward in which the engine fault fired first."""

    def __init__(self, fault: str) -> None:
        self.fault = fault
        self.first = 0

    def __call__(self, canary: EngineCanary, batch: ForwardBatch, kind: PoolKind) -> None:
        if not self.first and canary.engine.faults.fired[self.fault]:
            self.first = canary.forwards


def _run(fault: str, config: CanaryConfig, seed: int = 0) -> tuple[Engine, EngineCanary, _FireLog]:
    case = C.CASES_BY_NAME[fault]
    engine = C.build_engine(case.engine, faults=FaultConfig(seed=seed, **{fault: 1.0}))
    fired = _FireLog(fault)
    canary = EngineCanary(engine, config, on_forward=fired)
    C.WORKLOADS[case.workload](engine, random.Random(seed))
    canary.flush()
    return engine, canary, fired


def _structural(canary: EngineCanary) -> list[Violation]:
    return [v for v in canary.violations() if v.reasons & FailReason.STRUCTURAL]


def test_default_config_has_the_check_on() -> None:
    assert CanaryConfig().structural_check
    assert not CanaryConfig.from_env({"KVCANARY_STRUCTURAL_CHECK": "0"}).structural_check


def test_padding_row_writing_a_live_slot_is_reported_in_its_forward(backend: str) -> None:
    engine, canary, fired = _run("padding_write_live_slot", CanaryConfig(backend=backend))
    assert fired.first > 0
    first = canary.detections[0]
    assert first.forward == fired.first  # nothing before the fault, and the fault's own forward reports it
    rows = [v for v in first.report.violations if v.reasons & FailReason.STRUCTURAL]
    assert rows and all(v.tag.stage == Stage.HEAD for v in rows)
    v = rows[0]
    pad = engine.config.padding_row
    assert v.request_id is None and v.req_row == pad and v.expected_slot == NO_SLOT
    assert v.slot >= engine.config.reserved_slots  # a live slot, not the reserved one
    table = engine.req_to_token.table
    live_rows = [r for r in range(table.shape[0]) if r != pad and int(table[r, 0]) == v.slot]
    assert live_rows, "the slot belongs to no live request's position 0"


def test_out_cache_loc_disagreeing_with_req_to_token_names_both_slots(backend: str) -> None:
    engine, canary, fired = _run("stale_out_cache_loc", CanaryConfig(backend=backend))
    first = canary.detections[0]
    assert fired.first > 0 and first.forward == fired.first
    rows = [v for v in first.report.violations if v.reasons & FailReason.STRUCTURAL]
    assert rows
    # once per forward: the HEAD write of the first (FULL) group, K tag only, never again for SWA, V or TAIL
    assert all(v.tag == LaunchTag.HEAD_K_FULL for v in _structural(canary))
    assert len({(v.step, v.req_row, v.position) for v in rows}) == len(rows)
    for v in rows:
        assert v.request_id is not None
        assert v.slot != v.expected_slot and v.expected_slot >= engine.config.reserved_slots
        assert v.request_position == v.position
    # the first forward is the first prefill: request r0 at row ..., positions 0.. of its first chunk
    assert sorted({v.position for v in rows if v.request_id == rows[0].request_id})[0] == 0


def test_raise_mode_and_jsonl_carry_both_slots(tmp_path: Path, backend: str) -> None:
    path = tmp_path / "v.jsonl"
    config = CanaryConfig(backend=backend, mode=CanaryMode.RAISE, jsonl_path=str(path))
    with pytest.raises(CanaryViolationError) as err:
        _run("stale_out_cache_loc", config)
    v = err.value.violations[0]
    assert v.reasons & FailReason.STRUCTURAL
    assert f"slot={v.slot} expected_slot={v.expected_slot} position={v.position}" in str(err.value)
    rec = json.loads(path.read_text().splitlines()[0])
    assert rec["reasons"] == ["structural"]
    assert (rec["slot"], rec["expected_slot"], rec["position"], rec["req_row"]) == \
        (v.slot, v.expected_slot, v.position, v.req_row)


def test_log_mode_line_names_both_slots(caplog: pytest.LogCaptureFixture, backend: str) -> None:
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        _run("stale_out_cache_loc", CanaryConfig(backend=backend))
    lines = [r.getMessage() for r in caplog.records if "reasons=structural" in r.getMessage()]
    assert lines and "expected_slot=" in lines[0]


@pytest.mark.parametrize("fault", ["padding_write_live_slot", "stale_out_cache_loc"])
def test_switching_the_check_off_silences_the_forward(fault: str, backend: str) -> None:
    # fingerprints off too: the default policy's fingerprints also see a padding write (docs/defaults.md)
    config = CanaryConfig(backend=backend, structural_check=False, fingerprint="none", seal=False)
    _, canary, fired = _run(fault, config)
    assert fired.first > 0
    assert not _structural(canary)
    assert all(d.forward > fired.first for d in canary.detections)


@pytest.mark.parametrize("seed", [3, 4])
def test_clean_padded_runs_report_nothing_with_the_default_config(seed: int, backend: str) -> None:
    """The engine's padding rows write only the reserved slot and out_cache_loc always follows req_to_token."""
    res = C.run_clean(seed, 12, backend=backend, spec=seed % 2 == 0, config=CanaryConfig(backend=backend),
                      engine_overrides={"decode_pad_multiple": 4})
    assert res.violations == 0, res.first_violations
    assert res.input_errors == 0
