"""Seeded random workloads: arrivals, retracts, eviction pressure; outputs and bookkeeping stay exact."""

from __future__ import annotations

import random
from typing import Any

import pytest
from engine_shadow import ShadowChecker, assert_no_leak, sequential
from kvcanary.engine import Engine, EngineConfig, ModelConfig, Request, SamplingParams


def _workload(rng: random.Random, n: int) -> list[Request]:
    prefixes = [[rng.randrange(128) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    reqs = []
    for i in range(n):
        base = rng.choice(prefixes) if rng.random() < 0.7 else []
        tail = [rng.randrange(128) for _ in range(rng.randrange(1, 12))]
        temp = 0.0 if rng.random() < 0.5 else 0.9
        reqs.append(Request(f"q{i}", tuple(base + tail), rng.randrange(1, 16), SamplingParams(temp, i)))
    return reqs


def _drive(engine: Engine, reqs: list[Request], rng: random.Random) -> dict[str, list[int]]:
    pending = list(reqs)
    while pending or engine.scheduler.running or engine.scheduler.waiting:
        if pending and rng.random() < 0.4:
            engine.add_request(pending.pop(0))
        if engine.scheduler.running and rng.random() < 0.05:
            engine.retract(rng.choice(engine.scheduler.running).rid)
        if not engine.step() and not engine.scheduler.running and pending:
            engine.add_request(pending.pop(0))
    return engine.outputs()


@pytest.mark.parametrize(("seed", "cfg", "swa", "spec"), [
    (0, {"num_slots": 128, "chunk_size": 6}, False, False),
    (1, {"num_slots": 128, "chunk_size": 5, "page_size": 4, "decode_pad_multiple": 2}, True, False),
    (2, {"num_slots": 160, "chunk_size": 7, "spec_num_draft": 2}, False, True),
    (3, {"num_slots": 160, "chunk_size": 4, "spec_num_draft": 3, "page_size": 2}, True, True),
])
def test_soak(model_cfg: ModelConfig, swa_cfg: ModelConfig, draft_cfg: ModelConfig, seed: int,
              cfg: dict[str, Any], swa: bool, spec: bool) -> None:
    rng = random.Random(seed)
    model = swa_cfg if swa else model_cfg
    reqs = _workload(rng, 10)
    config = EngineConfig(max_running=6, num_swa_slots=96, **cfg)
    shadow = ShadowChecker(config.num_slots)
    engine = Engine(config, model, draft_cfg if spec else None, hooks=shadow)
    out = _drive(engine, reqs, rng)
    assert shadow.violations == []
    assert_no_leak(engine)
    assert out == sequential(reqs, model)
    assert engine.stats.prefix_hit_tokens > 0 and engine.stats.retractions > 0
    assert engine.stats.evicted_slots > 0
