"""CanaryConfig: defaults, validation naming the knob, KVCANARY_* environment."""

from __future__ import annotations

import pytest
from kvcanary.config import CanaryConfig, CanaryMode, CoveragePolicy, LayerCoverage, PerturbConfig, PerturbMode
from kvcanary.errors import CanaryInputError
from kvcanary_schema import DEFAULT_RING_CAPACITY, FingerprintMode, TokenTruth


def test_defaults() -> None:
    c = CanaryConfig()
    assert c.mode == CanaryMode.LOG and c.token_truth == TokenTruth.CHAIN and c.coverage == CoveragePolicy.FULL
    assert c.fingerprint == FingerprintMode.PARTIAL and c.layer_coverage == LayerCoverage.FIRST and c.sealing
    assert c.sweep_interval == 0 and c.sweep_slice > 0 and c.ring_capacity == DEFAULT_RING_CAPACITY
    assert not c.perturb.enabled and c.backend == "auto" and c.structural_check
    assert CanaryConfig(backend="torch").resolved_backend("cpu") == "torch"


def test_strings_are_coerced() -> None:
    c = CanaryConfig(mode="RAISE", fingerprint="partial", token_truth="pool", coverage="window",  # type: ignore[arg-type]
                     layer_coverage="sample", layer_stride=3)  # type: ignore[arg-type]
    assert (c.mode, c.fingerprint, c.token_truth, c.coverage) == (CanaryMode.RAISE, FingerprintMode.PARTIAL,
                                                                   TokenTruth.POOL, CoveragePolicy.WINDOW)
    assert c.layer_coverage == LayerCoverage.SAMPLE and c.layer_stride_for(8) == 3
    assert CanaryConfig(layer_coverage="all").layer_stride_for(8) == 1  # type: ignore[arg-type]


@pytest.mark.parametrize("knob,value", [("mode", "loud"), ("fingerprint", "most"), ("token_truth", "maybe"),
                                        ("coverage", "some"), ("ring_capacity", 0), ("stripe_size", 0),
                                        ("report_interval", 0), ("sweep_interval", -1), ("req_capacity", 0),
                                        ("backend", "tpu"), ("layer_stride", 0), ("token_capacity", True),
                                        ("eager_graphs", 1), ("seal", "yes")])
def test_validation_names_the_knob(knob: str, value: object) -> None:
    with pytest.raises(CanaryInputError, match=knob):
        CanaryConfig(**{knob: value})  # type: ignore[arg-type]


def test_perturb_validation() -> None:
    with pytest.raises(CanaryInputError, match="slot_swap"):
        PerturbConfig({PerturbMode.SLOT_SWAP: 1.5})
    with pytest.raises(CanaryInputError, match="warmup_steps"):
        PerturbConfig(warmup_steps=-1)
    with pytest.raises(CanaryInputError, match="perturb"):
        CanaryConfig(mode="none", perturb=PerturbConfig({PerturbMode.RECORD_FLIP: 0.5}))  # type: ignore[arg-type]


def test_from_env() -> None:
    env = {"KVCANARY_MODE": "raise", "KVCANARY_FINGERPRINT": "all", "KVCANARY_RING_CAPACITY": "64",
           "KVCANARY_COVERAGE": "window", "KVCANARY_STRIPE_SIZE": "32", "KVCANARY_INPUT_ASSERTS": "true",
           "KVCANARY_JSONL_PATH": "/tmp/x.jsonl", "KVCANARY_PERTURB_RECORD_FLIP_PROB": "0.25",
           "KVCANARY_PERTURB_WARMUP_STEPS": "3", "KVCANARY_PERTURB_SEED": "7", "UNRELATED": "1"}
    c = CanaryConfig.from_env(env)
    assert c.mode == CanaryMode.RAISE and c.fingerprint == FingerprintMode.ALL and c.ring_capacity == 64
    assert c.coverage == CoveragePolicy.WINDOW and c.stripe_size == 32 and c.input_asserts
    assert c.jsonl_path == "/tmp/x.jsonl"
    assert c.perturb.probability(PerturbMode.RECORD_FLIP) == 0.25 and c.perturb.warmup_steps == 3
    assert c.perturb.seed == 7
    assert CanaryConfig.from_env({}, ring_capacity=8).ring_capacity == 8
    assert CanaryConfig().eager_graphs and not CanaryConfig.from_env({"KVCANARY_EAGER_GRAPHS": "off"}).eager_graphs


@pytest.mark.parametrize("var,value,knob", [("KVCANARY_RING_CAPACITY", "many", "RING_CAPACITY"),
                                            ("KVCANARY_WATCHDOG", "perhaps", "WATCHDOG"),
                                            ("KVCANARY_PERTURB_SLOT_SWAP_PROB", "x", "SLOT_SWAP"),
                                            ("KVCANARY_MODE", "shout", "mode")])
def test_from_env_errors_name_the_variable(var: str, value: str, knob: str) -> None:
    with pytest.raises(CanaryInputError, match=knob):
        CanaryConfig.from_env({var: value})


def test_replace_revalidates() -> None:
    with pytest.raises(CanaryInputError, match="stats_interval"):
        CanaryConfig().replace(stats_interval=-2)
