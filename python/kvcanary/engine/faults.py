"""Seeded fault switches that re-introduce KV bookkeeping bugs (all off by default)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, fields

from .errors import ConfigError


@dataclass(frozen=True)
class FaultConfig:
    """Probability (0 = off, 1 = always) that each fault fires at each opportunity.

    - wrong_prefix_hit: a prefix-cache match returns another request's cached chain.
    - use_after_free: a finished request's pages that the radix cache still references are also
      pushed to the front of the free list, so the next allocation reuses them.
    - block_boundary_off_by_one: at a page boundary out_cache_loc uses the previous page's index
      (slot of position p - page_size), overwriting live KV while req_to_token says otherwise.
    - padding_write_live_slot: a padded decode row writes to a live slot instead of the reserved one.
    - stale_out_cache_loc: a new token's out_cache_loc names a free slot (a stale allocation) while
      req_to_token maps the token's own slot: its KV lands where nothing reads it.
    - spec_rollback_wrong_slots: rollback frees the page before the first rejected one (still
      referenced) and leaks the last one.
    - spec_stale_draft: rollback does not invalidate the rejected draft slot; the draft keeps KV
      computed for a rejected token and reads it next round.
    - trimmed_tail_still_read: rollback trims the token history but not the target KV length, so
      the next verify reads the rejected tail.
    - draft_position_off_by_one: (SGLang #25015) draft decode positions are shifted by +1.
    - draft_chunk_predicted_token: (SGLang #26329) at a chunked-prefill boundary the draft KV is
      computed for the target's predicted next token instead of the next prompt token.
    - resume_prompt_only_lookup: (SGLang #28254) the next chunk token is looked up in the prompt
      only (not prompt + output), so after retract+resume it falls back to the predicted token.
    - cached_kv_flip_reused: once, just before a request reuses a cached prefix, one low mantissa bit of V in the
      last full-attention layer flips at a random slot of that prefix (bit rot at rest, then reused).
    - cached_kv_flip_idle: once, at the start of a step, one low mantissa bit of K or V in a random full-attention
      layer flips at a random slot of an idle (unlocked) cached prefix (bit rot at rest).
    These two damage real KV only: they record their victim (request id, or IDLE_VICTIM) in `kv_victims`.
    """

    wrong_prefix_hit: float = 0.0
    use_after_free: float = 0.0
    block_boundary_off_by_one: float = 0.0
    padding_write_live_slot: float = 0.0
    stale_out_cache_loc: float = 0.0
    spec_rollback_wrong_slots: float = 0.0
    spec_stale_draft: float = 0.0
    trimmed_tail_still_read: float = 0.0
    draft_position_off_by_one: float = 0.0
    draft_chunk_predicted_token: float = 0.0
    resume_prompt_only_lookup: float = 0.0
    cached_kv_flip_reused: float = 0.0
    cached_kv_flip_idle: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name != "seed" and not 0.0 <= getattr(self, f.name) <= 1.0:
                raise ConfigError(f"fault probability {f.name} must be in [0, 1]")


_FAULT_NAMES = frozenset(f.name for f in fields(FaultConfig) if f.name != "seed")


class FaultInjector:
    """Draws fault decisions from one seeded RNG and counts how often each fault fired."""

    def __init__(self, config: FaultConfig | None = None) -> None:
        self.config = config or FaultConfig()
        self._rng = random.Random(self.config.seed)
        self.fired: Counter[str] = Counter()
        self.kv_victims: list[str] = []  # who a real-KV fault damaged (a request id, or IDLE_VICTIM)

    def fire(self, name: str) -> bool:
        """Whether fault `name` fires at this opportunity (no RNG draw when it is off)."""
        if name not in _FAULT_NAMES:
            raise ConfigError(f"unknown fault {name}")
        prob = float(getattr(self.config, name))
        if prob <= 0.0 or self._rng.random() >= prob:
            return False
        self.fired[name] += 1
        return True

    def fire_once(self, name: str) -> bool:
        """Like :meth:`fire`, but only until the fault fired once."""
        return not self.fired[name] and self.fire(name)

    def choice(self, n: int) -> int:
        """A seeded index in [0, n)."""
        return self._rng.randrange(n)


IDLE_VICTIM = "<idle cached prefix>"
