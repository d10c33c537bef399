"""Speculative decoding and retract/resume keep outputs identical and bookkeeping clean."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import make_requests
from engine_shadow import ShadowChecker, assert_no_leak, run_checked, sequential
from kvcanary.engine import (
    Engine,
    EngineConfig,
    ForwardMode,
    ModelConfig,
    PoolExhaustedError,
    PoolKind,
    Request,
    RequestError,
)


@pytest.mark.parametrize("cfg", [
    {"spec_num_draft": 3, "chunk_size": 4096},
    {"spec_num_draft": 1, "chunk_size": 7},
    {"spec_num_draft": 4, "chunk_size": 6, "page_size": 4},
    {"spec_num_draft": 2, "chunk_size": 9, "decode_pad_multiple": 4},
])
def test_spec_equals_plain(model_cfg: ModelConfig, draft_cfg: ModelConfig, cfg: dict[str, Any]) -> None:
    reqs = make_requests(4, new=14)
    engine, shadow, out = run_checked(reqs, model_cfg, draft_cfg, **cfg)
    assert out == sequential(reqs, model_cfg)
    assert engine.stats.spec_rounds > 0 and engine.stats.draft_forwards > 0
    drafts = [b for tag, b, kind in shadow.forwards if tag == "before" and kind == PoolKind.DRAFT]
    assert drafts and all(b.token_offset == 1 and b.pool_kind == PoolKind.DRAFT for b in drafts)
    modes = {b.mode for _, b, _ in shadow.forwards}
    assert {ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND} <= modes


def test_spec_with_target_as_draft_accepts_often(model_cfg: ModelConfig) -> None:
    reqs = make_requests(3, new=16)
    engine, _, out = run_checked(reqs, model_cfg, model_cfg, spec_num_draft=3, chunk_size=8)
    assert out == sequential(reqs, model_cfg)
    assert engine.stats.spec_accepted > 0.4 * engine.stats.spec_proposed
    assert engine.stats.spec_rounds < 15


def test_spec_sampling(model_cfg: ModelConfig, draft_cfg: ModelConfig) -> None:
    reqs = make_requests(3, new=12, temperature=0.8)
    _, _, out = run_checked(reqs, model_cfg, draft_cfg, spec_num_draft=3, chunk_size=8)
    assert out == sequential(reqs, model_cfg)


def test_spec_prefix_reuse(model_cfg: ModelConfig) -> None:
    reqs = make_requests(3, shared=16, prompt_len=4, new=8)
    shadow = ShadowChecker(1024)
    engine = Engine(EngineConfig(chunk_size=8, spec_num_draft=2), model_cfg, model_cfg, hooks=shadow)
    engine.generate(reqs[:1])
    out = engine.generate(reqs[1:])
    assert engine.stats.prefix_hit_tokens >= 2 * 15
    assert out == {k: v for k, v in sequential(reqs, model_cfg).items() if k != "r0"}
    assert shadow.violations == []
    assert_no_leak(engine)


def _run_with_retract(engine: Engine, reqs: list[Request], rid: str, at_step: int) -> dict[str, list[int]]:
    for r in reqs:
        engine.add_request(r)
    for _ in range(at_step):
        engine.step()
    engine.retract(rid)
    return {r.rid: engine.run_until_done()[r.rid] for r in reqs}


@pytest.mark.parametrize("at_step", [5, 14])
@pytest.mark.parametrize("spec", [0, 2])
def test_retract_resume(model_cfg: ModelConfig, draft_cfg: ModelConfig, at_step: int, spec: int) -> None:
    reqs = make_requests(3, prompt_len=20, new=12)
    shadow = ShadowChecker(1024)
    engine = Engine(EngineConfig(chunk_size=6, spec_num_draft=spec), model_cfg,
                    draft_cfg if spec else None, hooks=shadow)
    out = _run_with_retract(engine, reqs, "r1", at_step)
    assert out == sequential(reqs, model_cfg)
    assert engine.stats.retractions == 1 and engine.stats.prefix_hit_tokens > 0
    assert shadow.violations == []
    assert_no_leak(engine)


def test_retract_resume_without_cache(model_cfg: ModelConfig) -> None:
    reqs = make_requests(2, new=10)
    engine = Engine(EngineConfig(chunk_size=4, enable_prefix_cache=False), model_cfg)
    out = _run_with_retract(engine, reqs, "r0", 8)
    assert out == sequential(reqs, model_cfg)
    assert engine.stats.prefix_hit_tokens == 0


@pytest.mark.parametrize("cfg", [
    {"page_size": 1}, {"page_size": 4, "num_slots": 96}, {"spec_num_draft": 2},
    {"enable_prefix_cache": False}])
def test_auto_retract_under_pool_pressure(model_cfg: ModelConfig, draft_cfg: ModelConfig,
                                          cfg: dict[str, Any]) -> None:
    base = {"num_slots": 90, "chunk_size": 8, "max_running": 4}
    reqs = make_requests(4, prompt_len=10, new=24)
    engine, _, out = run_checked(reqs, model_cfg, draft_cfg if cfg.get("spec_num_draft") else None,
                                 **(base | cfg))
    assert engine.stats.retractions > 0
    assert out == sequential(reqs, model_cfg)


def test_pool_too_small_raises(model_cfg: ModelConfig) -> None:
    engine = Engine(EngineConfig(num_slots=64, max_context=512), model_cfg)
    with pytest.raises(RequestError):
        engine.add_request(Request("big", tuple(range(100)), 4))
    engine = Engine(EngineConfig(num_slots=40, auto_retract=False, chunk_size=8), model_cfg)
    with pytest.raises(PoolExhaustedError):
        engine.generate(make_requests(2, prompt_len=10, new=20))


def test_spec_prefix_reuse_past_another_requests_end(model_cfg: ModelConfig, draft_cfg: ModelConfig) -> None:
    """The draft slot at a cached chain's end holds KV of the inserter's next token: reuse must check it."""
    base = make_requests(1, prompt_len=16, new=4)[0]
    shadow = ShadowChecker(1024)
    engine = Engine(EngineConfig(chunk_size=8, spec_num_draft=2), model_cfg, draft_cfg, hooks=shadow)
    out0 = engine.generate([base])["r0"]
    fork = Request("fork", base.prompt + tuple(out0[:2]) + ((out0[2] + 1) % 128, 9, 9, 9), 5)
    out1 = engine.generate([fork])["fork"]
    follow = Request("follow", fork.prompt + tuple(out1) + (3, 4), 5)
    engine.generate([follow])
    assert engine.stats.prefix_hit_tokens > len(fork.prompt)
    assert shadow.violations == []
    assert_no_leak(engine)


@pytest.mark.parametrize("cfg", [
    {}, {"spec_num_draft": 3}, {"spec_num_draft": 1, "page_size": 4, "chunk_size": 3},
    {"chunk_size": 1, "decode_pad_multiple": 3}, {"chunk_size": 2, "mixed_batching": True, "page_size": 2}])
def test_edge_cases(model_cfg: ModelConfig, draft_cfg: ModelConfig, cfg: dict[str, Any]) -> None:
    """One-token prompts, one new token, identical prompts in one batch and again later."""
    reqs = [Request("a", (5,), 1), Request("b", (7,), 6), Request("c", tuple(range(1, 9)), 1),
            Request("d", (5,), 3), Request("e", tuple(range(1, 9)), 4)]
    draft = draft_cfg if cfg.get("spec_num_draft") else None
    engine, _, out = run_checked(reqs, model_cfg, draft, **cfg)
    again = [Request(r.rid + "2", r.prompt, r.max_new_tokens) for r in reqs]
    assert engine.generate(again) == {r.rid + "2": out[r.rid] for r in reqs}
    assert out == sequential(reqs, model_cfg)
