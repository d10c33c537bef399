"""Reference-engine glue for the roles: hand-off after prefill, install into own slots, model presets, workload."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvcanary.engine.engine import Engine, EngineConfig
from kvcanary.engine.errors import PoolExhaustedError
from kvcanary.engine.model import ModelConfig
from kvcanary.engine.scheduler import ReqState, Request, SamplingParams
from kvcanary.errors import CanaryInputError

MODELS: dict[str, ModelConfig] = {
    "full": ModelConfig(num_layers=3, seed=11),
    "swa": ModelConfig(num_layers=4, sliding_layers=(1, 3), sliding_window=8, seed=12),
    # KV rows of a realistic width (8 KV heads x 128 dims, bf16: 2 KiB per layer and half) for overhead figures
    "wide": ModelConfig(num_layers=8, num_heads=8, num_kv_heads=8, head_dim=128, hidden=256, intermediate=512,
                        dtype=torch.bfloat16, seed=13),
}


def model_config(name: str) -> ModelConfig:
    """A model preset: 'full' (full attention only), 'swa' (with sliding-window layers) or 'wide' (wide KV rows)."""
    if name not in MODELS:
        raise CanaryInputError(f"model must be one of {sorted(MODELS)}, got {name!r}")
    return MODELS[name]


def engine_config(num_slots: int = 1024, page_size: int = 1, prefix_cache: bool = True) -> EngineConfig:
    """Pool geometry shared by both roles (each side allocates its own slots)."""
    return EngineConfig(num_slots=num_slots, page_size=page_size, max_reqs=32, max_context=256, chunk_size=64,
                        max_running=8, num_swa_slots=num_slots // 2, enable_prefix_cache=prefix_cache)


@dataclass(frozen=True)
class Workload:
    """Seeded requests: ``count`` prompts of lengths in [min_len, max_len], ``max_new_tokens`` outputs each."""

    count: int = 4
    min_len: int = 12
    max_len: int = 40
    max_new_tokens: int = 6
    seed: int = 0

    def requests(self, vocab: int) -> list[Request]:
        """The request list (identical on both roles: the decode side's own knowledge of the prompts)."""
        if self.count < 1 or not 1 <= self.min_len <= self.max_len or self.max_new_tokens < 2:
            raise CanaryInputError("workload: count >= 1, 1 <= min_len <= max_len, max_new_tokens >= 2")
        rng = random.Random(self.seed)
        out = []
        for i in range(self.count):
            n = rng.randint(self.min_len, self.max_len)
            out.append(Request(request_id(i), tuple(rng.randrange(vocab) for _ in range(n)), self.max_new_tokens,
                               SamplingParams()))
        return out


def request_id(key: int) -> str:
    """The request id of a transfer key."""
    return f"req{key}"


def request_key(rid: str) -> int:
    """The transfer key of a request id."""
    return int(rid.removeprefix("req"))


class PrefillEngine(Engine):
    """An engine whose requests stop after their first token; ``on_prefilled`` sees each one before release."""

    on_prefilled: Callable[[PrefillEngine, ReqState], None] | None = None

    def _finish_done(self) -> None:
        if self.on_prefilled is not None:
            for state in [s for s in self.scheduler.running if s.remaining <= 0 and s.prefilled]:
                self.on_prefilled(self, state)
        super()._finish_done()

    def transfer_slots(self, state: ReqState) -> tuple[torch.Tensor, torch.Tensor]:
        """(table-space slots of positions [0, kv_len), SWA slots of the resident window suffix)."""
        n = state.kv_len
        full = self.req_to_token.table[state.row, :n].clone()
        if self.swa is None:
            return full, full[:0]
        lo = max(0, n - self.models.target.config.sliding_window)
        resident = self.swa.host[full[lo:].cpu()] >= 0
        missing = (~resident).nonzero()
        start = lo + (int(missing[-1]) + 1 if missing.numel() else 0)
        return full, self.swa.device_map[full[start:]]


class DecodeEngine(Engine):
    """An engine that installs transferred requests: ``reserve`` slots, then ``activate`` once the KV landed."""

    def reserve(self, request: Request, first_token: int, full_rows: int, swa_rows: int
                ) -> tuple[ReqState, torch.Tensor, torch.Tensor] | None:
        """Allocate a row, slots for positions [0, full_rows) and SWA slots for the last ``swa_rows`` of them.

        Returns (state, table slots, SWA slots), or None (nothing held) when the pool cannot take it now.
        """
        cfg, window = self.config, self.models.target.config.sliding_window
        if len(self.scheduler.running) >= cfg.max_running or self.req_to_token.num_free_rows == 0:
            return None
        if self.swa is None and swa_rows or swa_rows > min(full_rows, window):
            raise CanaryInputError(f"swa_rows {swa_rows} impossible for {full_rows} rows and window {window}")
        need = -(-(full_rows + 1) // cfg.page_size)
        if self._available_pages() < need:
            return None
        state = ReqState(request, [*request.prompt, first_token])
        row = self.req_to_token.alloc()
        state.row = -1 if row is None else row
        try:
            self._grow(state, full_rows)
            full = self.req_to_token.table[state.row, :full_rows].clone()
            swa = full[:0]
            if self.swa is not None:
                tail = full[full_rows - swa_rows:]
                self._assign_swa(tail.cpu().tolist())
                swa = self.swa.device_map[tail].clone()
        except PoolExhaustedError:
            self.drop(state)
            return None
        state.kv_len = state.draft_len = full_rows
        state.swa_freed_upto = full_rows - swa_rows
        state.prefilled = True
        return state, full, swa

    def activate(self, state: ReqState) -> None:
        """Start decoding an installed request (its first forward verifies the transferred prefix)."""
        self.scheduler.running.append(state)

    def drop(self, state: ReqState) -> None:
        """Free everything a reserved or running request holds without caching its KV (failed request)."""
        if state in self.scheduler.running:
            self.scheduler.running.remove(state)
        self._free_pages(state.pages)
        state.pages = []
        if state.row >= 0:
            self.req_to_token.free(state.row)
            state.row = -1

    def abort(self, rid: str) -> bool:
        """Drop a running request (its transferred KV failed a check); False if it is not running."""
        for state in self.scheduler.running:
            if state.rid == rid:
                self.drop(state)
                return True
        return False
