"""Host arrays to the device in one copy without a stream sync (a pageable ``.to(device)`` synchronizes the stream,
so the caller would wait for the work queued before it)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import overload

import numpy as np
import torch
from kvcanary_schema import NO_SLOT

from kvcanary.adapter import PrefixCacheExport


@overload
def packed(parts: Sequence[np.ndarray], flags: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    ...


@overload
def packed(parts: Sequence[np.ndarray], flags: None, device: torch.device) -> tuple[torch.Tensor, None]: ...


def packed(parts: Sequence[np.ndarray], flags: np.ndarray | None,
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The int64 ``parts`` (concatenated) and the bool ``flags`` (None: none) on ``device`` in one copy: one host
    buffer (pinned for CUDA; torch's pinned allocator keeps it until the copy has run) holds both. Only a plain copy:
    no kernel launch."""
    n = sum(p.size for p in parts)
    nf = 0 if flags is None else flags.size
    host = torch.empty(8 * n + nf, dtype=torch.uint8, pin_memory=device.type == "cuda")
    h = host.numpy()
    np.concatenate(parts, out=h[:8 * n].view(np.int64))
    if flags is not None:
        h[8 * n:] = flags
    on = host.to(device, non_blocking=True)
    return on[:8 * n].view(torch.int64), None if flags is None else on[8 * n:].view(torch.bool)


def export_of_blocks(blocks: np.ndarray, first_positions: np.ndarray, parents: np.ndarray, page: int,
                     unlocked: np.ndarray | None, device: torch.device) -> PrefixCacheExport:
    """A paged prefix cache's export (one chain of ``page`` slots per block; ``parents``: the block each one follows,
    -1 for none): the per-block facts built on the host and moved in one copy, the ``page`` slots of each block
    expanded on the device (a host array of every slot would be ``page`` times larger, to build and to copy)."""
    n = blocks.shape[0]
    prev = np.where(parents >= 0, parents * page + page - 1, NO_SLOT)
    starts = np.arange(0, n * page, page, dtype=np.int64)
    ints, flags = packed((blocks, starts, np.full(n, page, dtype=np.int64), first_positions, prev), unlocked, device)
    b, starts_d, lens, first, prev_d = ints.view(5, n).unbind()
    slots = torch.add(_page_offsets(page, device), b.view(n, 1), alpha=page).view(-1)
    return PrefixCacheExport(slots, starts_d, lens, first, prev_d, flags)


@functools.cache
def _page_offsets(page: int, device: torch.device) -> torch.Tensor:
    """0 .. page-1 on ``device`` (int64), made once."""
    return torch.arange(page, dtype=torch.int64, device=device)
