"""Hook protocol through which an integrity checker observes forwards and slot lifecycles."""

from __future__ import annotations

from typing import Protocol

import torch

from .batch import ForwardBatch, PoolKind


class EngineHooks(Protocol):
    """Callbacks of the engine; `slots` are int64 device tensors of full-pool slot indices."""

    def before_forward(self, batch: ForwardBatch, pool_kind: PoolKind) -> None:
        """Right before a model forward (the new KV is not written yet)."""

    def after_forward(self, batch: ForwardBatch, pool_kind: PoolKind) -> None:
        """Right after a model forward (the new KV is written)."""

    def on_alloc(self, slots: torch.Tensor) -> None:
        """Slots were handed to a request."""

    def on_free(self, slots: torch.Tensor) -> None:
        """Slots went back to the free list (finish, retract, eviction, speculative rollback); CPU int64."""


class NullHooks:
    """Hooks that do nothing."""

    def before_forward(self, batch: ForwardBatch, pool_kind: PoolKind) -> None:
        """Do nothing."""

    def after_forward(self, batch: ForwardBatch, pool_kind: PoolKind) -> None:
        """Do nothing."""

    def on_alloc(self, slots: torch.Tensor) -> None:
        """Do nothing."""

    def on_free(self, slots: torch.Tensor) -> None:
        """Do nothing."""


class RecordingHooks(NullHooks):
    """Hooks that keep every call (for tests and debugging)."""

    def __init__(self) -> None:
        self.forwards: list[tuple[str, ForwardBatch, PoolKind]] = []
        self.allocated: list[torch.Tensor] = []
        self.freed: list[torch.Tensor] = []

    def before_forward(self, batch: ForwardBatch, pool_kind: PoolKind) -> None:
        """Record the call."""
        self.forwards.append(("before", batch, pool_kind))

    def after_forward(self, batch: ForwardBatch, pool_kind: PoolKind) -> None:
        """Record the call."""
        self.forwards.append(("after", batch, pool_kind))

    def on_alloc(self, slots: torch.Tensor) -> None:
        """Record the slots."""
        self.allocated.append(slots.cpu())

    def on_free(self, slots: torch.Tensor) -> None:
        """Record the slots."""
        self.freed.append(slots.cpu())
