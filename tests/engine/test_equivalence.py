"""Batched generation equals one-request-at-a-time generation, and the bookkeeping stays clean."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import make_requests
from engine_shadow import ShadowChecker, run_checked, sequential
from kvcanary.engine import (
    ConfigError,
    Engine,
    EngineConfig,
    ForwardBatch,
    ForwardMode,
    ModelConfig,
    NullHooks,
    PoolKind,
    Request,
    RequestError,
)


@pytest.mark.parametrize("cfg", [
    {"chunk_size": 4096},
    {"chunk_size": 7},
    {"chunk_size": 5, "page_size": 4, "num_slots": 1024},
    {"chunk_size": 16, "mixed_batching": True},
    {"chunk_size": 16, "decode_pad_multiple": 4},
    {"chunk_size": 3, "enable_prefix_cache": False, "max_running": 2},
])
def test_batched_equals_sequential(model_cfg: ModelConfig, cfg: dict[str, Any]) -> None:
    reqs = make_requests(5)
    engine, _, out = run_checked(reqs, model_cfg, **cfg)
    assert out == sequential(reqs, model_cfg)
    assert engine.stats.max_batch_size > 1


def test_chunked_prefill_really_chunks(model_cfg: ModelConfig) -> None:
    reqs = make_requests(2, prompt_len=30)
    engine, shadow, _ = run_checked(reqs, model_cfg, chunk_size=8)
    extends = [b for tag, b, _ in shadow.forwards if tag == "before" and b.mode == ForwardMode.EXTEND]
    assert len(extends) >= 8 and max(b.num_tokens for b in extends) <= 8
    assert engine.stats.chunks == len(extends)


def test_prefix_reuse(model_cfg: ModelConfig) -> None:
    reqs = make_requests(4, shared=24, prompt_len=6)
    expected = sequential(reqs, model_cfg)
    shadow = ShadowChecker(1024)
    engine = Engine(EngineConfig(chunk_size=8), model_cfg, hooks=shadow)
    engine.generate(reqs[:1])
    mark = len(shadow.forwards)
    out = engine.generate(reqs[1:])
    assert out == {k: v for k, v in expected.items() if k != "r0"}
    assert engine.stats.prefix_hit_tokens >= 3 * 24
    assert shadow.violations == []
    first = next(b for tag, b, _ in shadow.forwards[mark:] if tag == "before")
    assert int(first.prefix_lens[0]) >= 24


def test_prefix_reuse_page_size(model_cfg: ModelConfig) -> None:
    reqs = make_requests(3, shared=13, prompt_len=5)
    engine = Engine(EngineConfig(chunk_size=8, page_size=4), model_cfg)
    engine.generate(reqs[:1])
    out = engine.generate(reqs[1:])
    assert out == {k: v for k, v in sequential(reqs, model_cfg).items() if k != "r0"}
    assert engine.stats.prefix_hit_tokens == 2 * 12


def test_sampling_is_batch_invariant(model_cfg: ModelConfig) -> None:
    reqs = make_requests(4, temperature=1.0)
    _, _, out = run_checked(reqs, model_cfg, chunk_size=5)
    assert out == sequential(reqs, model_cfg)
    greedy = sequential(make_requests(4), model_cfg)
    assert out != greedy


def test_sliding_window(swa_cfg: ModelConfig) -> None:
    reqs = make_requests(4, prompt_len=18, new=12)
    engine, _, out = run_checked(reqs, swa_cfg, chunk_size=5, num_swa_slots=128)
    assert out == sequential(reqs, swa_cfg)
    assert engine.swa is not None
    resident = int((engine.swa.host[1:] >= 0).sum())
    assert resident <= engine.radix.total_slots() if engine.radix else resident == 0


class _SwaResidency(ShadowChecker):
    """Also checks that the last window - 1 prefix positions of every target row are SWA-resident."""

    def __init__(self, window: int) -> None:
        super().__init__(1024)
        self.window = window
        self.engine: Engine | None = None
        self.missing = 0

    def before_forward(self, batch: ForwardBatch, pool_kind: PoolKind) -> None:
        super().before_forward(batch, pool_kind)
        if pool_kind != PoolKind.TARGET or self.engine is None or self.engine.swa is None:
            return
        table, smap = batch.req_to_token.cpu(), self.engine.swa.device_map.cpu()
        for i in range(batch.real_batch_size):
            pre = batch.prefix_lens_host[i]
            slots = table[batch.req_pool_indices_host[i], max(0, pre - self.window + 1):pre]
            self.missing += int((smap[slots] < 0).sum())


def test_sliding_window_keeps_needed_positions_resident(swa_cfg: ModelConfig) -> None:
    reqs = make_requests(4, shared=10, prompt_len=18, new=12)
    hooks = _SwaResidency(swa_cfg.sliding_window)
    engine = Engine(EngineConfig(chunk_size=5, num_swa_slots=128, spec_num_draft=2), swa_cfg,
                    ModelConfig(num_layers=1, dtype=torch.float64), hooks=hooks)
    hooks.engine = engine
    engine.generate(reqs[:1])
    out = engine.generate(reqs[1:])
    assert hooks.missing == 0 and hooks.violations == []
    assert out == {k: v for k, v in sequential(reqs, swa_cfg).items() if k != "r0"}


def test_sliding_window_frees_out_of_window_slots(swa_cfg: ModelConfig) -> None:
    engine = Engine(EngineConfig(chunk_size=4, num_swa_slots=64, enable_prefix_cache=False), swa_cfg)
    for r in make_requests(2, prompt_len=30, new=20):
        engine.add_request(r)
    peak = 0
    while engine.step():
        assert engine.swa is not None
        peak = max(peak, engine.swa.num_swa_slots - 1 - engine.swa.num_free)
    window, chunk = swa_cfg.sliding_window, 4
    assert peak <= 2 * (window + chunk)
    assert engine.swa is not None and engine.swa.num_free == 63


def test_sliding_window_prefix_reuse_multi_turn(swa_cfg: ModelConfig) -> None:
    first = make_requests(1, prompt_len=20, new=8)[0]
    engine, shadow, out = run_checked([first], swa_cfg, chunk_size=8, num_swa_slots=256)
    turn2 = Request("turn2", first.prompt + tuple(out["r0"]) + (5, 6, 7), 6)
    mark = len(shadow.forwards)
    out2 = engine.generate([turn2])
    assert engine.stats.prefix_hit_tokens == len(first.prompt) + 7
    assert out2 == sequential([turn2], swa_cfg)
    assert shadow.violations == []
    assert len(shadow.forwards) > mark
    # a prefix whose last window is no longer SWA-resident is not reused
    other = Request("other", first.prompt[:12] + (1, 2, 3), 2)
    before = engine.stats.prefix_hit_tokens
    engine.generate([other])
    assert engine.stats.prefix_hit_tokens == before


def test_pool_view_and_cached_chains(swa_cfg: ModelConfig) -> None:
    engine = Engine(EngineConfig(chunk_size=8, num_slots=256, num_swa_slots=64), swa_cfg)
    engine.generate(make_requests(2))
    view = engine.pool_view()
    assert view.num_slots == 256 and view.reserved_slots == 1 and view.padding_row == 0
    assert view.swa_layers == (1,) and view.full_layers == (0, 2) and view.swa_window == 6
    assert view.k[1].shape[0] == 64 and view.k[0].shape == (256, 2, 16)
    assert view.full_to_swa is not None and view.full_to_swa.dtype == torch.int64
    assert [t.shape[0] for t in view.sources("swa", "v")] == [64]
    assert len(view.sources("full", "k")) == 2
    chains = engine.cached_chains()
    assert int(chains.chain_lens.sum()) == chains.slots.numel() > 0
    assert bool(chains.unlocked.all())
    assert engine.pool_view(PoolKind.TARGET).token_offset == 0


def test_hooks_see_alloc_and_free(model_cfg: ModelConfig) -> None:
    engine, shadow, _ = run_checked(make_requests(3), model_cfg, enable_prefix_cache=False)
    alloc = torch.cat(shadow.allocated).sort().values
    freed = torch.cat(shadow.freed).sort().values
    assert torch.equal(alloc, freed)
    befores = [b for tag, b, _ in shadow.forwards if tag == "before"]
    assert len(befores) == engine.stats.forwards


def test_flush_cache_frees_everything(model_cfg: ModelConfig) -> None:
    engine, shadow, _ = run_checked(make_requests(3), model_cfg)
    assert engine.radix is not None and engine.radix.total_slots() > 0
    engine.flush_cache()
    assert engine.allocator.num_free_pages == engine.allocator.num_pages
    assert engine.cached_chains().num_chains == 0
    assert torch.equal(torch.cat(shadow.allocated).sort().values, torch.cat(shadow.freed).sort().values)


@pytest.mark.parametrize("cfg", [
    {"reserved_slots": 0, "padding_row": None},
    {"reserved_slots": 4, "padding_row": 3, "decode_pad_multiple": 4, "page_size": 2},
])
def test_reserved_slots_and_padding_row(model_cfg: ModelConfig, cfg: dict[str, Any]) -> None:
    reqs = make_requests(3, new=8)
    engine, shadow, out = run_checked(reqs, model_cfg, chunk_size=8, **cfg)
    assert out == sequential(reqs, model_cfg)
    used = torch.cat(shadow.allocated)
    assert int(used.min()) >= cfg["reserved_slots"]
    if cfg["padding_row"] is not None:
        pads = [b for tag, b, _ in shadow.forwards if tag == "before" and b.num_padding]
        assert pads and all(b.req_pool_indices_host[-1] == 3 for b in pads)
        assert all(int(b.out_cache_loc[-1]) == 0 for b in pads)
        rows = {r for _, b, _ in shadow.forwards for r in b.req_pool_indices_host[:b.real_batch_size]}
        assert 3 not in rows


def test_bad_configs(model_cfg: ModelConfig, draft_cfg: ModelConfig, swa_cfg: ModelConfig) -> None:
    with pytest.raises(ConfigError):
        EngineConfig(decode_pad_multiple=2, padding_row=None)
    with pytest.raises(ConfigError):
        Engine(EngineConfig(spec_num_draft=2), model_cfg)
    with pytest.raises(ConfigError):
        Engine(EngineConfig(spec_num_draft=2), model_cfg, swa_cfg)
    with pytest.raises(ConfigError):
        Engine(EngineConfig(num_slots=30, page_size=4), model_cfg)
    engine = Engine(EngineConfig(), model_cfg)
    engine.add_request(make_requests(1)[0])
    with pytest.raises(RequestError):
        engine.add_request(make_requests(1)[0])
    with pytest.raises(RequestError):
        engine.add_request(Request("x", (999,), 2))
    with pytest.raises(ConfigError):
        engine.pool_view(PoolKind.DRAFT)


def _chains_by_holder(c: Any) -> list[tuple[Any, ...]]:
    """A CachedChains as sorted tuples (holders, slots, first position, prev slot, unlocked) per chain."""
    out = []
    for i in range(c.num_chains):
        s, n = int(c.chain_starts[i]), int(c.chain_lens[i])
        out.append((c.holders[i], tuple(c.slots[s:s + n].tolist()), int(c.first_positions[i]),
                    int(c.prev_slots[i]), bool(c.unlocked[i])))
    return sorted(out)


def _resident_reference(engine: Engine) -> list[tuple[Any, ...]]:
    """resident_chains the slow way: the radix nodes one by one, then each running request's uncached tail."""
    assert engine.radix is not None
    table = engine.req_to_token.table.cpu()
    out = [(nd.holders, tuple(nd.value.tolist()), nd.start,
            int(nd.parent.value[-1]) if nd.parent is not None and nd.parent is not engine.radix.root else -1,
            nd.lock_ref == 0) for nd in engine.radix.nodes()]
    for s in engine.scheduler.running:
        if s.row >= 0 and s.kv_len > s.cached_len:
            out.append(((s.rid,), tuple(table[s.row, s.cached_len:s.kv_len].tolist()), s.cached_len,
                        int(table[s.row, s.cached_len - 1]) if s.cached_len else -1, False))
    return sorted(out)


class _ExportChecker(NullHooks):
    """After every forward: the vectorized export equals the reference, and stays one object while unchanged."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.checked, self.reused = engine, 0, 0

    def after_forward(self, batch: ForwardBatch, pool_kind: PoolKind) -> None:
        e = self.engine
        assert _chains_by_holder(e.resident_chains()) == _resident_reference(e)
        self.reused += e.cached_chains() is e.cached_chains()
        self.checked += 1


@pytest.mark.parametrize("cfg", [{"chunk_size": 7}, {"chunk_size": 5, "page_size": 4, "num_slots": 1024}])
def test_resident_chains_match_reference_every_forward(model_cfg: ModelConfig, cfg: dict[str, Any]) -> None:
    check_resident_chains(model_cfg, cfg, "cpu")


def check_resident_chains(model_cfg: ModelConfig, cfg: dict[str, Any], device: str) -> None:
    """Run an engine on ``device`` whose hooks compare its vectorized export with the reference after every
    forward."""
    engine = Engine(EngineConfig(**cfg), model_cfg, device=device)
    checker = _ExportChecker(engine)
    engine.hooks = checker
    engine.generate(make_requests(9, shared=12, new=6))
    assert checker.checked == engine.stats.forwards and checker.reused == checker.checked
    assert engine.radix is not None and engine.cached_chains().num_chains > 0
