"""CanaryConfig() defaults (docs/defaults.md): every fault class caught within its stated bound, and quarantine."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from kvcanary import campaign as C
from kvcanary.config import CanaryConfig
from kvcanary.engine import Engine, FaultConfig, Request, SamplingParams
from kvcanary.engine.canary import EngineCanary
from kvcanary_schema import FailReason, FingerprintMode, Half, Stage

from tests.e2e.test_fault_campaign import effective_trial


@pytest.mark.parametrize("case", C.CASES, ids=[c.name for c in C.CASES])
def test_default_policy_catches_every_class(case: C.FaultCase, backend: str) -> None:
    trial = effective_trial(case, 11, backend, policy="default")
    assert not trial.false_positive, trial
    assert trial.detected and trial.stage_ok and trial.reason_ok and trial.request_ok, trial
    assert 0 <= trial.forwards_to_detect <= trial.bound, trial
    if case.detect == "sweep":  # the rolling sweep's bound on the campaign engine: one slice (4 x 512 slot ids)
        # walks its 1024-slot pool, every 4 forwards
        assert trial.bound == CanaryConfig().sweep_roll_interval == 4


@pytest.mark.parametrize(("name", "change"), [
    ("cached_kv_flip_reused", {"seal": False}),  # 16 bytes of one layer per slot cannot see one flipped bit
    ("cached_kv_flip_reused", {"reuse_check": False, "sweep_slice": 0}),
    ("cached_kv_flip_idle", {"sweep_slice": 0}),  # idle: only a sweep reads it
    ("cached_kv_flip_idle", {"fingerprint": FingerprintMode.NONE}),
])
def test_bit_rot_needs_the_seal_and_its_checks(name: str, change: dict[str, object], backend: str) -> None:
    """Negative controls: without the seal, the reuse check or the rolling sweep the default misses bit rot."""
    case = C.CASES_BY_NAME[name]
    with_default = effective_trial(case, 5, backend, policy="default")
    assert with_default.ok, with_default
    without = C.run_trial(case, with_default.seed, backend=backend, policy="default", **change)  # type: ignore
    assert without.fired and not without.ok, without


def test_sweep_row_names_the_cached_chain(backend: str) -> None:
    """A rolling-sweep row carries the chain's first position, length and the requests that last held it."""
    case = C.CASES_BY_NAME["cached_kv_flip_idle"]
    engine = C.build_engine(case.engine, faults=FaultConfig(cached_kv_flip_idle=1.0, seed=2))
    canary = EngineCanary(engine, C.default_config(backend))
    C.two_turns(engine, random.Random(2))
    canary.flush()
    rows = [v for v in canary.violations() if v.tag.stage == Stage.SWEEP]
    assert rows and all(v.chain is not None for v in rows)
    chain = rows[0].chain
    assert chain is not None and chain.length > 0 and chain.first_position >= 0
    assert "a" in chain.holders  # the first turn's request wrote the idle prefix
    assert "chain_length=" in rows[0].line() and rows[0].to_dict()["chain"]["holders"]


def _reuse_workload(engine: Engine, seed: int) -> dict[str, list[int]]:
    """A writes a prefix; B runs (A's prefix idle in the cache); C reuses A's prefix. C's output is returned."""
    rng = random.Random(seed)
    prompt = tuple(rng.randrange(C.VOCAB) for _ in range(24))
    sampling = SamplingParams(1.0, seed=9)
    engine.generate([Request("a", prompt, 4, sampling)])
    engine.generate([Request("b", tuple(rng.randrange(C.VOCAB) for _ in range(12)), 6, sampling)])
    return engine.generate([Request("c", prompt + (3, 4), 6, sampling)])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quarantine_turns_a_bad_cached_block_into_a_recompute(seed: int, backend: str) -> None:
    """Bit rot in A's idle cached prefix: the rolling sweep reports it, the report's quarantine evicts it from the
    radix cache, and C (which would have reused it) recomputes and gets exactly the clean run's output."""
    logging.getLogger("kvcanary").setLevel(logging.ERROR)
    clean_engine = C.build_engine()
    EngineCanary(clean_engine, C.default_config(backend))
    clean = _reuse_workload(clean_engine, seed)
    assert clean_engine.stats.prefix_hit_tokens > 0  # C reuses A's prefix in the clean run

    bad = C.build_engine(faults=FaultConfig(cached_kv_flip_idle=1.0, seed=seed))
    canary = EngineCanary(bad, C.default_config(backend))
    out = _reuse_workload(bad, seed)
    assert bad.faults.fired["cached_kv_flip_idle"] == 1
    found = [v for v in canary.violations() if v.tag.stage == Stage.SWEEP]
    assert found and all(int(v.reasons) & int(FailReason.VERIFY_FINGERPRINT) for v in found)
    assert bad.stats.quarantined_slots > 0
    assert out["c"] == clean["c"]
    # the control: without quarantine C reuses the whole (corrupted) prefix, as in the clean run; with it, less
    unguarded = C.build_engine(faults=FaultConfig(cached_kv_flip_idle=1.0, seed=seed))
    EngineCanary(unguarded, C.default_config(backend), quarantine=False)
    _reuse_workload(unguarded, seed)
    assert unguarded.stats.prefix_hit_tokens == clean_engine.stats.prefix_hit_tokens
    assert bad.stats.prefix_hit_tokens < clean_engine.stats.prefix_hit_tokens


def _decoding(backend: str, **config: object) -> tuple[Engine, EngineCanary, int]:
    """A request in decode on the campaign engine (no prefix cached yet: every slot is its own); its slot row."""
    engine = C.build_engine()
    canary = EngineCanary(engine, C.default_config(backend, **config))
    rng = random.Random(4)
    engine.add_request(Request("r", tuple(rng.randrange(C.VOCAB) for _ in range(30)), 24, SamplingParams(1.0, seed=1)))
    while engine.stats.forwards < 4:
        engine.step()
    return engine, canary, engine.scheduler.get_running("r").row


def _found(canary: EngineCanary, slot: int, stage: Stage, half: Half | None = None) -> list[int]:
    """Engine forwards whose report has a fingerprint row of ``stage`` (and ``half``, if given) at ``slot``."""
    canary.flush()
    return [d.forward for d in canary.detections for v in d.report.violations
            if v.slot == slot and v.tag.stage == stage and half in (None, v.tag.half)
            and int(v.reasons) & int(FailReason.VERIFY_FINGERPRINT)]


@pytest.mark.parametrize("position", [0, 1, 7, 12, 29])
def test_whole_slot_overwrite_is_caught_in_the_forward_that_reads_it(position: int, backend: str) -> None:
    """A stray write of a slot (its rows in every layer, K and V) is seen by the very next forward's TAIL verify,
    at every position (the partial fingerprint samples the first layer)."""
    engine, canary, row = _decoding(backend)
    slot = int(engine.req_to_token.table[row, position])
    pool, g = engine.models.target_pool, torch.Generator().manual_seed(position)
    for layer in (0, 2):  # the target model's full-attention layers
        for t in (pool.k[layer], pool.v[layer]):
            t[slot] = torch.randn(t[slot].shape, generator=g).to(t.dtype)
    before = canary.forwards
    engine.step()
    assert _found(canary, slot, Stage.TAIL)[:1] == [before + 1]


@pytest.mark.parametrize(("layer", "half"), [(0, "k"), (0, "v"), (2, "k"), (2, "v")])
def test_single_bit_flip_in_any_layer_is_caught_within_the_rolling_bound(layer: int, half: str, backend: str) -> None:
    """One flipped mantissa bit anywhere in a running request's own slot (outside the 16 sampled bytes): the
    rolling sweep (resident chains, checked against the seal) reports it within its bound (C.sweep_bound)."""
    engine, canary, row = _decoding(backend)
    slot = int(engine.req_to_token.table[row, 9])
    t = (engine.models.target_pool.k if half == "k" else engine.models.target_pool.v)[layer]
    elem = t[slot].view(-1)[-1:].view(torch.uint8)  # the row's last element: never in the partial 16 bytes
    elem[0] ^= 1
    before, bound = canary.forwards, C.sweep_bound(CanaryConfig(), engine.config.num_slots)
    for _ in range(bound):
        engine.step()
    found = _found(canary, slot, Stage.SWEEP)
    assert found and found[0] - before <= bound, (found, before, bound)
    assert not _found(canary, slot, Stage.TAIL)  # the per-forward partial fingerprint cannot see it


@pytest.mark.parametrize("half_coverage", ["first", "each"])
def test_v_damage_in_the_sampled_bytes_by_half_coverage(half_coverage: str, backend: str) -> None:
    """A flipped bit inside V's sampled 16 bytes (first layer) of a read slot. half_coverage "first" (the default:
    V's per-forward fingerprint hashes no bytes) leaves it to the seal: the rolling sweep reports it within its
    bound and no TAIL row does; "each" sees it in the next forward's TAIL verify, tagged V."""
    engine, canary, row = _decoding(backend, half_coverage=half_coverage)
    slot = int(engine.req_to_token.table[row, 9])
    engine.models.target_pool.v[0][slot].view(-1)[:1].view(torch.uint8)[0] ^= 1  # byte 0: inside the sample
    before, bound = canary.forwards, C.sweep_bound(CanaryConfig(), engine.config.num_slots)
    for _ in range(bound):
        engine.step()
    if half_coverage == "each":
        assert _found(canary, slot, Stage.TAIL, Half.V)[:1] == [before + 1]
    else:
        assert not _found(canary, slot, Stage.TAIL)
    assert not _found(canary, slot, Stage.TAIL, Half.K)  # K's bytes are intact
    found = _found(canary, slot, Stage.SWEEP, Half.V)
    assert found and found[0] - before <= bound, (found, before, bound)
