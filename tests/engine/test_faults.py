"""Every fault switch fires in a targeted scenario and leaves a detectable inconsistency."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from conftest import make_requests
from engine_shadow import ShadowChecker
from kvcanary.engine import ConfigError, Engine, EngineConfig, FaultConfig, FaultInjector, ModelConfig, Request

Scenario = Callable[[Engine], None]


def _two_turns(engine: Engine) -> None:
    a, b = make_requests(2, prompt_len=12, new=6)
    engine.generate([a])
    engine.generate([b])
    engine.generate([Request("again", a.prompt + (1, 2), 4)])


def _batch(engine: Engine) -> None:
    engine.generate(make_requests(3, prompt_len=12, new=10))


def _retract_in_decode(engine: Engine) -> None:
    # temperature 1: with greedy decoding the predicted token equals the output and hides the bug
    reqs = make_requests(1, prompt_len=10, new=30, temperature=1.0)
    for r in reqs:
        engine.add_request(r)
    for _ in range(12):
        engine.step()
    engine.retract("r0")
    engine.run_until_done()


def _engine(model: ModelConfig, draft: ModelConfig | None, faults: FaultConfig,
            shadow: ShadowChecker, **cfg: int | bool) -> Engine:
    return Engine(EngineConfig(**cfg), model, draft, hooks=shadow, faults=faults)  # type: ignore[arg-type]


CASES: list[tuple[str, dict[str, int | bool], bool, Scenario]] = [
    ("wrong_prefix_hit", {"chunk_size": 8}, False, _two_turns),
    ("use_after_free", {"chunk_size": 8}, False, _two_turns),
    ("block_boundary_off_by_one", {"chunk_size": 8, "page_size": 4}, False, _batch),
    ("padding_write_live_slot", {"chunk_size": 8, "decode_pad_multiple": 4}, False, _batch),
    ("stale_out_cache_loc", {"chunk_size": 8}, False, _batch),
    ("spec_rollback_wrong_slots", {"chunk_size": 8, "spec_num_draft": 3}, True, _batch),
    ("spec_stale_draft", {"chunk_size": 8, "spec_num_draft": 3}, True, _batch),
    ("trimmed_tail_still_read", {"chunk_size": 8, "spec_num_draft": 3}, True, _batch),
    ("draft_position_off_by_one", {"chunk_size": 8, "spec_num_draft": 3}, True, _batch),
    ("draft_chunk_predicted_token", {"chunk_size": 5, "spec_num_draft": 2}, True, _batch),
    ("resume_prompt_only_lookup", {"chunk_size": 4, "spec_num_draft": 2,
                                   "enable_prefix_cache": False}, True, _retract_in_decode),
]


@pytest.mark.parametrize(("name", "cfg", "spec", "scenario"), CASES, ids=[c[0] for c in CASES])
def test_fault_fires_and_is_detectable(model_cfg: ModelConfig, draft_cfg: ModelConfig, name: str,
                                       cfg: dict[str, int | bool], spec: bool,
                                       scenario: Scenario) -> None:
    shadow = ShadowChecker(1024)
    engine = _engine(model_cfg, draft_cfg if spec else None, FaultConfig(**{name: 1.0}), shadow, **cfg)
    scenario(engine)
    assert engine.faults.fired[name] > 0
    assert shadow.violations, f"{name} left no trace"

    clean_shadow = ShadowChecker(1024)
    clean = _engine(model_cfg, draft_cfg if spec else None, FaultConfig(), clean_shadow, **cfg)
    scenario(clean)
    assert clean_shadow.violations == [] and not clean.faults.fired


def test_resume_bug_needs_a_resume(model_cfg: ModelConfig, draft_cfg: ModelConfig) -> None:
    shadow = ShadowChecker(1024)
    engine = _engine(model_cfg, draft_cfg, FaultConfig(resume_prompt_only_lookup=1.0), shadow,
                     chunk_size=4, spec_num_draft=2)
    engine.generate(make_requests(2, prompt_len=10, new=8))
    assert not engine.faults.fired and shadow.violations == []


def test_faults_are_seeded(model_cfg: ModelConfig) -> None:
    def run(seed: int) -> list[tuple[str, str, str, int]]:
        shadow = ShadowChecker(1024)
        engine = _engine(model_cfg, None, FaultConfig(block_boundary_off_by_one=0.3, seed=seed),
                         shadow, chunk_size=8)
        _batch(engine)
        return shadow.violations

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_fault_config_validation() -> None:
    with pytest.raises(ConfigError):
        FaultConfig(use_after_free=1.5)
    with pytest.raises(ConfigError):
        FaultInjector().fire("no_such_fault")
    assert not FaultInjector().fire("use_after_free")
