"""Paged K/V pools, the SWA slot map, req_to_token and the page allocator."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from .errors import ConfigError, DoubleFreeError, PoolExhaustedError
from .model import ModelConfig


class SlotAllocator:
    """Free list of pages; a page is `page_size` contiguous slots; leading reserved slots never leave."""

    def __init__(self, num_slots: int, page_size: int = 1, reserved_slots: int = 1) -> None:
        if page_size < 1:
            raise ConfigError("page_size must be >= 1")
        if reserved_slots < 0 or num_slots % page_size:
            raise ConfigError("num_slots must be a multiple of page_size; reserved_slots >= 0")
        self.num_slots, self.page_size, self.reserved_slots = num_slots, page_size, reserved_slots
        self.first_page = -(-reserved_slots // page_size)
        if self.first_page >= num_slots // page_size:
            raise ConfigError("no allocatable page left after the reserved slots")
        self._free: deque[int] = deque(range(self.first_page, num_slots // page_size))
        self._is_free = [False] * self.first_page + [True] * len(self._free)

    @property
    def num_pages(self) -> int:
        """Allocatable pages in total."""
        return self.num_slots // self.page_size - self.first_page

    @property
    def num_free_pages(self) -> int:
        """Pages currently on the free list."""
        return len(self._free)

    def is_free(self, page: int) -> bool:
        """Whether a page is on the free list."""
        return self._is_free[page]

    def next_free_slot(self) -> int | None:
        """First slot of the page the next allocation would hand out (None when no page is free)."""
        return self._free[0] * self.page_size if self._free else None

    def alloc(self, num_pages: int) -> list[int] | None:
        """Pop `num_pages` pages, or return None (and take nothing) when too few are free."""
        if num_pages > len(self._free):
            return None
        pages = [self._free.popleft() for _ in range(num_pages)]
        for p in pages:
            self._is_free[p] = False
        return pages

    def free(self, pages: list[int], front: bool = False) -> None:
        """Return pages to the free list (front=True makes them the next ones handed out)."""
        for p in pages:
            if not self.first_page <= p < len(self._is_free) or self._is_free[p]:
                raise DoubleFreeError(f"page {p} is reserved, out of range or already free")
            self._is_free[p] = True
            if front:
                self._free.appendleft(p)
            else:
                self._free.append(p)

    def force_free(self, pages: list[int]) -> None:
        """Put pages at the front of the free list even if still in use (fault injection only)."""
        for p in pages:
            if not self._is_free[p]:
                self._is_free[p] = True
                self._free.appendleft(p)

    def page_slots(self, pages: list[int]) -> torch.Tensor:
        """All slots of the given pages, in page order (CPU int64)."""
        base = torch.tensor(pages, dtype=torch.int64) * self.page_size
        return (base[:, None] + torch.arange(self.page_size)[None, :]).reshape(-1)


class ReqToTokenPool:
    """`req_to_token[max_reqs, max_context]` (int64, device) plus a free list of rows."""

    def __init__(self, max_reqs: int, max_context: int, device: torch.device,
                 padding_row: int | None = 0) -> None:
        if max_reqs < 1 or max_context < 1:
            raise ConfigError("max_reqs and max_context must be positive")
        if padding_row is not None and not 0 <= padding_row < max_reqs:
            raise ConfigError("padding_row must be a valid row")
        self.max_reqs, self.max_context, self.padding_row = max_reqs, max_context, padding_row
        self.table = torch.zeros(max_reqs, max_context, dtype=torch.int64, device=device)
        self._free = deque(r for r in range(max_reqs) if r != padding_row)
        if not self._free:
            raise ConfigError("no request row left besides the padding row")

    @property
    def num_free_rows(self) -> int:
        """Rows available for new requests."""
        return len(self._free)

    def alloc(self) -> int | None:
        """Take a free row, or None."""
        return self._free.popleft() if self._free else None

    def free(self, row: int) -> None:
        """Return a row."""
        if row == self.padding_row or row in self._free or not 0 <= row < self.max_reqs:
            raise DoubleFreeError(f"request row {row} is not in use")
        self._free.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Set req_to_token[row, start:start+len(slots)] = slots."""
        end = start + slots.numel()
        if end > self.max_context:
            raise PoolExhaustedError(f"context {end} exceeds max_context {self.max_context}")
        self.table[row, start:end] = slots.to(self.table.device, non_blocking=True)


class SwaMap:
    """SWA slot allocator and the full→SWA slot map (-1 = not resident); host mirror + device copy."""

    def __init__(self, num_slots: int, num_swa_slots: int, reserved_slots: int,
                 device: torch.device) -> None:
        if num_swa_slots <= reserved_slots:
            raise ConfigError("num_swa_slots must exceed reserved_slots")
        self.num_swa_slots = num_swa_slots
        self.host = torch.full((num_slots,), -1, dtype=torch.int64)
        self.host[:reserved_slots] = torch.arange(reserved_slots)
        self.device_map = self.host.to(device)
        self._free: deque[int] = deque(range(reserved_slots, num_swa_slots))

    @property
    def num_free(self) -> int:
        """SWA slots available."""
        return len(self._free)

    def assign(self, full_slots: list[int]) -> bool:
        """Give each non-resident full slot an SWA slot; False (nothing changed) if too few free."""
        todo = [s for s in full_slots if int(self.host[s]) < 0]
        if len(todo) > len(self._free):
            return False
        if todo:
            swa = [self._free.popleft() for _ in todo]
            self._set(todo, swa)
        return True

    def release(self, full_slots: list[int]) -> None:
        """Free the SWA slots of the given full slots (non-resident ones are skipped)."""
        idx = torch.tensor(full_slots, dtype=torch.int64)
        if idx.numel() == 0:
            return
        cur = self.host[idx]
        live = cur >= 0
        if bool(live.any()):
            self._free.extend(cur[live].tolist())
            self._set(idx[live].tolist(), [-1] * int(live.sum()))

    def resident(self, full_slots: torch.Tensor) -> torch.Tensor:
        """Host bool mask: which full slots have an SWA slot."""
        return self.host[full_slots] >= 0

    def _set(self, full: list[int], swa: list[int]) -> None:
        idx, val = torch.tensor(full, dtype=torch.int64), torch.tensor(swa, dtype=torch.int64)
        self.host[idx] = val
        self.device_map[idx.to(self.device_map.device)] = val.to(self.device_map.device)


class KVPool:
    """Per-layer K and V tensors `[slots, kv_heads, head_dim]`; sliding layers live in the SWA pool."""

    def __init__(self, config: ModelConfig, num_slots: int, device: torch.device,
                 swa: SwaMap | None = None, token_offset: int = 0) -> None:
        if config.sliding_layers and swa is None:
            raise ConfigError("a model with sliding layers needs an SwaMap")
        self.config, self.swa, self.token_offset = config, swa, token_offset
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        for layer in range(config.num_layers):
            rows = swa.num_swa_slots if swa and layer in config.sliding_layers else num_slots
            shape = (rows, config.num_kv_heads, config.head_dim)
            self.k.append(torch.zeros(shape, dtype=config.dtype, device=device))
            self.v.append(torch.zeros(shape, dtype=config.dtype, device=device))

    def _rows(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Translate full slots to the rows of this layer's tensor."""
        if self.swa is not None and layer in self.config.sliding_layers:
            return self.swa.device_map[slots]
        return slots

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new K/V of a layer at the given full slots."""
        rows = self._rows(layer, slots)
        self.k[layer][rows] = k
        self.v[layer][rows] = v

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather K/V of a layer at the given full slots."""
        rows = self._rows(layer, slots)
        return self.k[layer][rows], self.v[layer][rows]


@dataclass(frozen=True)
class PoolView:
    """What an integrity checker needs to know about one pool (target or draft)."""

    num_slots: int
    page_size: int
    reserved_slots: int
    padding_row: int | None
    full_layers: tuple[int, ...]
    swa_layers: tuple[int, ...]
    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]
    full_to_swa: torch.Tensor | None
    num_swa_slots: int
    swa_window: int
    token_offset: int
    req_to_token: torch.Tensor

    def sources(self, group: str, half: str) -> tuple[torch.Tensor, ...]:
        """Real-KV tensors of a group ("full" or "swa") and half ("k" or "v"), in layer order."""
        if group not in ("full", "swa") or half not in ("k", "v"):
            raise ConfigError("group must be 'full' or 'swa' and half 'k' or 'v'")
        layers = self.full_layers if group == "full" else self.swa_layers
        tensors = self.k if half == "k" else self.v
        return tuple(tensors[i] for i in layers)
