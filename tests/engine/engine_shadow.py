"""A minimal token/position shadow record per slot: a test oracle for the engine's bookkeeping."""

from __future__ import annotations

from typing import Any

import torch
from kvcanary.engine import (
    Engine,
    EngineConfig,
    ForwardBatch,
    ModelConfig,
    PoolKind,
    RecordingHooks,
    Request,
)


class ShadowChecker(RecordingHooks):
    """Writes (token, position) per slot on every forward and verifies every prefix before reading.

    This mimics what a KV canary does (record written from out_cache_loc, verified through
    req_to_token against the true history, cleared on free) so tests can show that the clean
    engine is consistent and that every fault switch produces a detectable inconsistency.
    """

    def __init__(self, num_slots: int, reserved_slots: int = 1) -> None:
        super().__init__()
        self.reserved = reserved_slots
        self.records = {kind: torch.full((num_slots, 2), -1, dtype=torch.int64) for kind in PoolKind}
        self.violations: list[tuple[str, str, str, int]] = []

    def before_forward(self, batch: ForwardBatch, pool_kind: PoolKind) -> None:
        super().before_forward(batch, pool_kind)
        rec, off = self.records[pool_kind], batch.token_offset
        table = batch.req_to_token.cpu()
        for i in range(batch.real_batch_size):
            pre, hist = batch.prefix_lens_host[i], torch.tensor(batch.token_history(i))
            n = max(0, min(pre, hist.numel() - off))
            slots = table[batch.req_pool_indices_host[i], :n]
            got = rec[slots]
            pos = torch.arange(n)
            bad = (got[:, 0] != hist[off:off + n]) | (got[:, 1] != pos)
            for p in torch.nonzero(bad).flatten().tolist():
                self.violations.append(("read", pool_kind.value, batch.req_ids[i], p))

    def after_forward(self, batch: ForwardBatch, pool_kind: PoolKind) -> None:
        super().after_forward(batch, pool_kind)
        rec, off = self.records[pool_kind], batch.token_offset
        ids, pos, loc = batch.input_ids.cpu(), batch.positions.cpu(), batch.out_cache_loc.cpu()
        start = 0
        for i in range(batch.real_batch_size):
            pre, ext, hist = batch.prefix_lens_host[i], batch.extend_lens_host[i], batch.token_history(i)
            for t in range(ext):
                p = int(pos[start + t])
                truth_ok = p + off >= len(hist) or hist[p + off] == int(ids[start + t])
                if p != pre + t or not truth_ok:
                    self.violations.append(("write", pool_kind.value, batch.req_ids[i], p))
            start += ext
        rec[loc, 0] = ids
        rec[loc, 1] = pos
        rec[: self.reserved] = -1

    def on_free(self, slots: torch.Tensor) -> None:
        super().on_free(slots)
        for rec in self.records.values():
            rec[slots.cpu()] = -1


def sequential(reqs: list[Request], model: ModelConfig) -> dict[str, list[int]]:
    """Reference: each request alone, unchunked, no prefix cache."""
    out: dict[str, list[int]] = {}
    for r in reqs:
        engine = Engine(EngineConfig(chunk_size=4096, enable_prefix_cache=False), model)
        out.update(engine.generate([r]))
    return out


def run_checked(reqs: list[Request], model: ModelConfig, draft: ModelConfig | None = None,
                **cfg: Any) -> tuple[Engine, ShadowChecker, dict[str, list[int]]]:
    """Run with the shadow checker; assert no violation and no leaked page."""
    config = EngineConfig(**cfg)
    shadow = ShadowChecker(config.num_slots, config.reserved_slots)
    engine = Engine(config, model, draft, hooks=shadow)
    out = engine.generate(reqs)
    assert shadow.violations == []
    assert_no_leak(engine)
    return engine, shadow, out


def assert_no_leak(engine: Engine) -> None:
    cached = engine.radix.total_slots() if engine.radix else 0
    size = engine.config.page_size
    assert engine.allocator.num_free_pages + cached // size == engine.allocator.num_pages
    padding = 0 if engine.config.padding_row is None else 1
    assert engine.req_to_token.num_free_rows == engine.config.max_reqs - padding
