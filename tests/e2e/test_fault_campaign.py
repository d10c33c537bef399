"""Every bug class and perturbation mode injected into a running engine is reported by the expected check."""

from __future__ import annotations

import pytest
from kvcanary import campaign as C
from kvcanary.config import PerturbMode
from kvcanary.perturb import EXPECTED
from kvcanary_schema import FingerprintMode, Stage, TokenTruth

SEEDS = (0, 1)


def effective_trial(case: C.FaultCase, seed: int, backend: str, **changes: object) -> C.TrialResult:
    """A trial whose fault damaged something (a fault may fire without effect: try the next seeds)."""
    for k in range(6):
        trial = C.run_trial(case, 1000 * seed + k, backend=backend, **changes)  # type: ignore[arg-type]
        if trial.fired:
            return trial
    pytest.fail(f"{case.name}: the fault never took effect in 6 seeded runs")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", C.CASES, ids=[c.name for c in C.CASES])
def test_fault_is_reported_by_its_check(case: C.FaultCase, seed: int, backend: str) -> None:
    trial = effective_trial(case, seed, backend)
    assert not trial.false_positive, f"violation before the fault: {trial}"
    assert trial.detected, f"{case.name} not reported: {trial}"
    assert trial.stage_ok and trial.reason_ok, f"{case.name}: expected {case.stages} {case.reasons!r}: {trial}"
    assert trial.request_ok, f"{case.name}: wrong attribution: {trial}"
    assert 0 <= trial.forwards_to_detect <= case.bound, f"{case.name}: too late: {trial}"
    if case.detect == "per-forward":
        assert (trial.request is not None or case.on_padding) and trial.tag.startswith(("HEAD", "TAIL"))
    else:
        assert trial.tag.startswith("SWEEP") or trial.request is not None


@pytest.mark.parametrize("name", ["draft_position_off_by_one", "draft_chunk_predicted_token",
                                  "resume_prompt_only_lookup"])
def test_sglang_regressions_on_the_torch_reference(name: str) -> None:
    """The three SGLang regression bugs, caught with the torch reference backend as well."""
    case = C.CASES_BY_NAME[name]
    trial = effective_trial(case, 7, "torch")
    assert trial.ok, trial
    assert trial.pool == "draft" and trial.forwards_to_detect == 0


TRUTH_CASES = [c for c in C.CASES if c.needs == "token truth"]


@pytest.mark.parametrize("case", TRUTH_CASES, ids=[c.name for c in TRUTH_CASES])
def test_token_truth_is_what_catches_it(case: C.FaultCase, backend: str) -> None:
    """Without token truth these faults leave self-consistent chains: the expected check stays silent."""
    with_truth = effective_trial(case, 3, backend)
    assert with_truth.ok
    without = C.run_trial(case, with_truth.seed, backend=backend, token_truth=TokenTruth.OFF)
    assert without.fired and not without.ok, f"{case.name} caught without token truth: {without}"


STRUCTURAL = [c for c in C.CASES if c.needs.startswith(("chain", "structural"))]


@pytest.mark.parametrize("case", STRUCTURAL, ids=[c.name for c in STRUCTURAL])
def test_structural_faults_need_neither_truth_nor_fingerprints(case: C.FaultCase, backend: str) -> None:
    """What the table calls chain/position faults is caught with token truth and fingerprints both off."""
    trial = effective_trial(case, 5, backend, token_truth=TokenTruth.OFF, fingerprint=FingerprintMode.NONE)
    assert trial.ok, trial


def test_fingerprints_are_what_catch_kv_corruption(backend: str) -> None:
    """KV byte corruption is invisible without fingerprints (the perturbation modes even refuse to run)."""
    from kvcanary.errors import CanaryInputError
    with pytest.raises(CanaryInputError):
        C.run_trial(C.CASES_BY_NAME["perturb:multi_bit_flip"], 0, backend=backend, fingerprint=FingerprintMode.NONE)


@pytest.mark.parametrize("name", ["padding_write_live_slot", "stale_out_cache_loc"])
def test_structural_check_is_what_catches_misplaced_writes(name: str, backend: str) -> None:
    """A write to the wrong slot leaves every record self-consistent: without the structural check and without
    fingerprints nothing is reported; the structural check alone reports it in the forward where it happens."""
    case = C.CASES_BY_NAME[name]
    alone = effective_trial(case, 4, backend, fingerprint=FingerprintMode.NONE, token_truth=TokenTruth.OFF)
    assert alone.ok and alone.forwards_to_detect == 0, alone
    without = C.run_trial(case, alone.seed, backend=backend, fingerprint=FingerprintMode.NONE,
                          structural_check=False)
    assert without.fired and not without.ok, without
    if name == "padding_write_live_slot":  # records never see a padding write
        assert not without.detected, without


def test_case_table_covers_bug_classes_and_perturb_modes() -> None:
    covered = {c.perturb for c in C.PERTURB_CASES}
    # transfer corruption needs a prefill->decode transfer: covered by the disaggregation tests
    assert covered == set(PerturbMode) - {PerturbMode.TRANSFER_CORRUPTION}
    for c in C.PERTURB_CASES:
        assert c.perturb is not None and EXPECTED[c.perturb].reason == c.reasons
    classes = " ".join(c.bug_class for c in C.CASES)
    for tag in ("#1", "#2", "#3", "#4", "#5", "#10", "#11", "#12", "#13", "SGLang bug 1", "SGLang bug 2",
                "SGLang bug 3"):
        assert tag in classes, tag
    assert all(c.needs and c.detect in ("per-forward", "sweep") for c in C.CASES)
    assert {s for c in C.CASES for s in c.stages} >= {Stage.HEAD, Stage.TAIL, Stage.SWEEP}


def test_select() -> None:
    assert C.select("none") == [] and len(C.select("all")) == len(C.CASES)
    assert [c.name for c in C.select("slot_swap, wrong_prefix_hit")] == ["perturb:slot_swap", "wrong_prefix_hit"]
    with pytest.raises(ValueError, match="unknown fault"):
        C.select("no_such_fault")
