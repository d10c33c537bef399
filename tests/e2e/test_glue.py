"""The engine glue: pool description, batch view, prefix-cache export, invalidation on free, modes."""

from __future__ import annotations

import random

import pytest
import torch
from kvcanary import campaign as C
from kvcanary.config import CanaryConfig, CanaryMode
from kvcanary.engine import FaultConfig, ForwardBatch, PoolKind, RecordingHooks, Request
from kvcanary.engine.canary import NO_TRUE_TOKEN, EngineCanary, batch_view, pool_description
from kvcanary.report import CanaryViolationError
from kvcanary_schema import NO_SLOT, Group, RecordField


def test_pool_description_of_target_and_draft_pools() -> None:
    engine = C.build_engine((("decode_pad_multiple", 2),), spec=False)
    target = pool_description(engine.pool_view(PoolKind.TARGET), engine.device)
    assert [g.group for g in target.groups] == [Group.FULL, Group.SWA]
    full, swa = target.groups
    assert full.num_slots == engine.config.num_slots and swa.num_slots == engine.config.num_swa_slots
    assert swa.window == C.TARGET_MODEL.sliding_window and swa.swa_map is engine.swa.device_map  # type: ignore[union-attr]
    assert full.sources is not None and len(full.sources[0]) == len(C.TARGET_MODEL.full_layers)
    assert target.padding_row == engine.config.padding_row and target.token_offset == 0
    assert (target.req_rows, target.max_context) == tuple(engine.req_to_token.table.shape)
    spec = C.build_engine((("spec_num_draft", 2),), spec=True)
    draft = pool_description(spec.pool_view(PoolKind.DRAFT), spec.device)
    assert [g.group for g in draft.groups] == [Group.FULL] and draft.token_offset == 1


def _batches(engine_cfg: tuple[tuple[str, object], ...], spec: bool, reqs: list[Request]) -> list[ForwardBatch]:
    engine = C.build_engine(engine_cfg, spec)
    rec = RecordingHooks()
    engine.hooks = rec
    engine.generate(reqs)
    return [b for when, b, _ in rec.forwards if when == "before"]


def test_batch_view_padding_rows_and_truth() -> None:
    rng = random.Random(0)
    reqs = [Request(f"r{i}", C._prompt(rng, 6 + i), 4) for i in range(3)]
    padded = [b for b in _batches((("decode_pad_multiple", 4),), False, reqs) if b.num_padding]
    assert padded
    view = batch_view(padded[0])
    assert view.batch_size == padded[0].batch_size
    assert list(view.request_ids[-padded[0].num_padding:]) == [None] * padded[0].num_padding
    assert view.true_tokens is not None and all(len(t) == 0 for t in view.true_tokens[-padded[0].num_padding:])
    assert all(NO_TRUE_TOKEN not in t for t in view.true_tokens)


def test_prefix_running_past_the_history_gets_no_true_token() -> None:
    rng = random.Random(1)
    reqs = [Request("r0", C._prompt(rng, 8), 6)]
    b = _batches((), False, reqs)[-1]
    hist = b.histories[0]
    shifted = ForwardBatch(**{**b.__dict__, "prefix_lens_host": (len(hist) + 2,)})
    truth = batch_view(shifted).true_tokens
    assert truth is not None and list(truth[0]) == [*hist, NO_TRUE_TOKEN, NO_TRUE_TOKEN]
    draft = ForwardBatch(**{**shifted.__dict__, "token_offset": 1, "pool_kind": PoolKind.DRAFT})
    assert batch_view(draft).true_tokens == (hist,)  # the draft legitimately runs ahead of the history


def test_prefix_cache_export_and_draft_boundaries() -> None:
    engine = C.build_engine((("spec_num_draft", 2), ("chunk_size", 8)), spec=True)
    rng = random.Random(2)
    C.shared_waves(engine, rng)
    # the exports the managers' sweeps read
    export = {k: m.prefix_cache for k, m in EngineCanary(engine, C.canary_config("cpu")).managers.items()}
    target, draft = export[PoolKind.TARGET](), export[PoolKind.DRAFT]()
    assert target is not None and draft is not None and target.num_chains > 1
    heads = target.prev_slots == NO_SLOT
    assert torch.equal(draft.prev_slots[heads], target.prev_slots[heads])
    assert bool((draft.prev_slots[~heads] == engine.config.num_slots).all())
    assert torch.equal(draft.slots, target.slots)
    assert export[PoolKind.DRAFT]() is draft  # an unchanged cache: the same export (nothing derived again)
    no_cache = EngineCanary(C.build_engine((("enable_prefix_cache", False),)), C.canary_config("cpu"))
    assert all(m.prefix_cache is None or m.prefix_cache() is None for m in no_cache.managers.values())


def test_freed_slots_are_invalidated(backend: str) -> None:
    engine = C.build_engine((("enable_prefix_cache", False),))
    canary = EngineCanary(engine, C.canary_config(backend))
    freed: list[torch.Tensor] = []
    inner = canary.on_free

    def spy(slots: torch.Tensor) -> None:
        freed.append(slots.clone())
        inner(slots)
    engine.hooks = canary
    canary.on_free = spy  # type: ignore[method-assign]
    engine.generate([Request("r0", C._prompt(random.Random(3), 10), 5)])
    assert freed and canary.total == 0
    slots = torch.cat(freed)
    for g in canary.target.state.groups[:1]:
        for view in (g.head, g.tail):
            assert bool((view.records[slots, :, RecordField.POSITION] == -1).all())


def test_raise_mode_names_the_affected_request(backend: str) -> None:
    engine = C.build_engine((("chunk_size", 8),), faults=FaultConfig(wrong_prefix_hit=1.0))
    EngineCanary(engine, C.canary_config(backend, mode=CanaryMode.RAISE))
    with pytest.raises(CanaryViolationError) as err:
        C.two_turns(engine, random.Random(0))
    assert err.value.request_ids == ["b"]


def test_mode_none_installs_nothing() -> None:
    engine = C.build_engine((("chunk_size", 8),))
    canary = EngineCanary(engine, CanaryConfig(mode=CanaryMode.NONE))
    C.batch(engine, random.Random(0))
    assert canary.forwards > 0 and canary.total == 0 and not canary.target.enabled
    canary.flush()
    canary.sweep()
