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
from kvcanary.errors import CanaryInputError
from kvcanary.streams import CurrentStream


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


class StagedRows:
    """Up to ``width`` int64 values in each of ``rows`` rows, written on the host and copied to the device in one copy
    per call, through one persistent host buffer (pinned for CUDA) into one persistent device buffer (on the CPU they
    are one buffer). For facts a caller stages every forward: no allocation, no stream sync, and each width's device
    row views made once. The device rows are overwritten by the next :meth:`put`: work that reads them must be queued
    on the current stream before it (stream order protects it)."""

    def __init__(self, rows: int, width: int, device: torch.device) -> None:
        self.width = width
        self._dev = torch.zeros((rows, width), dtype=torch.int64, device=device)
        cuda = device.type == "cuda"
        self._host = torch.zeros((rows, width), dtype=torch.int64, pin_memory=True) if cuda else self._dev
        self._np = self._host.numpy()
        # CUDA: the last copy out of the host buffer (the next put overwrites the buffer once it has run)
        self._copied = torch.cuda.Event() if cuda else None  # type: ignore[no-untyped-call]
        self._stream = CurrentStream(self._dev.device.index or 0) if cuda else None
        self._views: dict[int, tuple[torch.Tensor, ...]] = {}
        self._host_views: dict[int, tuple[np.ndarray, ...]] = {}

    def put(self, values: Sequence[Sequence[int]] | np.ndarray, n: int) -> tuple[torch.Tensor, ...]:
        """``values`` (``rows`` rows of ``n`` <= ``width`` values each) on the device: one contiguous int64 view of
        ``n`` values per row."""
        if not 0 <= n <= self.width:
            raise CanaryInputError(f"{n} values per row, staged rows hold at most {self.width}")
        if self._copied is not None:
            self._copied.synchronize()
        self._np[:, :n] = values
        if self._copied is not None and self._stream is not None:
            self._dev.copy_(self._host, non_blocking=True)  # queued on the device buffer's device's current stream
            self._copied.record(self._stream.get())
        v = self._views.get(n)
        if v is None:
            v = self._views[n] = self._dev[:, :n].unbind()
        return v

    def host_rows(self, n: int) -> tuple[np.ndarray, ...]:
        """The host buffer's rows as the last :meth:`put` of ``n`` values left them (contiguous int64 views, valid
        until the next put): the same facts without converting them again."""
        h = self._host_views.get(n)
        if h is None:
            h = self._host_views[n] = tuple(self._np[:, :n])
        return h
