"""ForwardBatch: the device-side description of one model forward."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class PoolKind(enum.StrEnum):
    """Which model and pool a forward runs on."""

    TARGET = "target"
    DRAFT = "draft"


class ForwardMode(enum.StrEnum):
    """What a forward does."""

    EXTEND = "extend"
    DECODE = "decode"
    TARGET_VERIFY = "target_verify"
    DRAFT_EXTEND = "draft_extend"
    DRAFT_DECODE = "draft_decode"


@dataclass(frozen=True)
class ForwardBatch:
    """One forward. Rows [0, real_bs) are requests; the last `num_padding` rows are padding.

    `token_offset` is 0 for the target pool and 1 for the EAGLE-style draft pool, whose slot at
    position p holds KV computed for the token at p + 1. `histories[i]` is request i's committed
    true token history (prompt + outputs so far; never draft proposals).
    """

    mode: ForwardMode
    pool_kind: PoolKind
    token_offset: int
    req_ids: tuple[str, ...]
    req_pool_indices: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    req_to_token: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    histories: tuple[tuple[int, ...], ...]
    num_padding: int
    req_pool_indices_host: tuple[int, ...]
    prefix_lens_host: tuple[int, ...]
    extend_lens_host: tuple[int, ...]

    @property
    def batch_size(self) -> int:
        """Rows including padding."""
        return len(self.req_pool_indices_host)

    @property
    def real_batch_size(self) -> int:
        """Rows that are requests."""
        return self.batch_size - self.num_padding

    @property
    def num_tokens(self) -> int:
        """Tokens in the forward, padding included."""
        return int(self.input_ids.numel())

    def token_history(self, i: int) -> tuple[int, ...]:
        """Committed true tokens of request row i (prompt + outputs so far)."""
        return self.histories[i]
