"""Clean randomized workloads report nothing: no violation, no input error, every tag running."""

from __future__ import annotations

import pytest
from kvcanary import campaign as C
from kvcanary_schema import TokenTruth


@pytest.mark.parametrize(("seed", "spec"), [(11, False), (12, False), (13, True), (14, True)])
def test_clean_mixed_workload_has_no_violation(seed: int, spec: bool, backend: str) -> None:
    res = C.run_clean(seed, 14, backend=backend, spec=spec)
    assert res.violations == 0, res.first_violations
    assert res.input_errors == 0 and res.health_problems == []
    assert res.forwards > 20 and res.entries_checked > 0 and res.sweeps > 0
    assert (res.draft_forwards > 0) == spec


def test_clean_run_exercises_the_hard_paths(backend: str) -> None:
    """A small pool forces eviction and retraction; shared prompts give prefix hits; long prompts chunk."""
    res = C.run_clean(5, 24, backend=backend, spec=False,
                      engine_overrides={"num_slots": 256, "chunk_size": 8, "page_size": 2, "max_running": 6,
                                        "num_swa_slots": C.swa_slots_needed({"chunk_size": 8, "max_running": 6,
                                                                             "page_size": 2})})
    assert res.violations == 0 and res.health_problems == [], (res.first_violations, res.health_problems)
    assert res.prefix_hit_tokens > 0 and res.evicted_slots > 0 and res.chunks > res.target_forwards // 4
    assert res.retractions > 0


def test_clean_run_with_the_expected_token_pool(backend: str) -> None:
    """Token truth as a per-entry pool (SGLang parity) is just as silent on a clean run."""
    res = C.run_clean(21, 10, backend=backend, spec=True, config=C.canary_config(backend, token_truth=TokenTruth.POOL))
    assert res.violations == 0, res.first_violations


def test_torch_reference_and_cpu_backend_agree_on_a_clean_run() -> None:
    a = C.run_clean(31, 8, backend="torch", spec=True)
    b = C.run_clean(31, 8, backend="cpu", spec=True)
    assert a.violations == b.violations == 0
    assert (a.forwards, a.entries_checked, a.entries_written, a.sweeps) == \
        (b.forwards, b.entries_checked, b.entries_written, b.sweeps)
