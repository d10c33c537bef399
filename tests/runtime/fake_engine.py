"""A tiny in-test paged-KV engine (pool, slot table, allocator, prefix cache, decode loop) for runtime tests."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from kvcanary.adapter import BatchView, GroupSpec, PoolDescription, PrefixCacheExport
from kvcanary.ops.types import SourceSpec
from kvcanary_schema import NO_SLOT, Group


@dataclass
class Req:
    """One request: its slot-table row, true history and how many of its tokens are in the KV."""

    rid: str
    row: int
    history: list[int]
    kv_len: int = 0
    cached_from: int | None = None  # prefix-cache chain in use (locked)


@dataclass
class Chain:
    """A cached prefix: slots and tokens from position 0."""

    slots: list[int]
    tokens: list[int]
    locks: int = 0


@dataclass
class FakeEngine:
    """Deterministic engine: KV of (token, position, layer) is a fixed function, so fingerprints are stable."""

    num_slots: int = 96
    req_rows: int = 8
    max_context: int = 48
    layers: int = 2
    dim: int = 8
    halves: int = 2
    swa_window: int = 0
    device: str = "cpu"
    padding_row: int = 0  # row 0 and slot 0 are reserved for padded batch entries
    reqs: dict[str, Req] = field(default_factory=dict)
    cache: list[Chain] = field(default_factory=list)

    def __post_init__(self) -> None:
        d = torch.device(self.device)
        self.kv = [[torch.zeros(self.num_slots, self.dim, device=d) for _ in range(self.layers)]
                   for _ in range(self.halves)]
        self.req_to_token = torch.zeros(self.req_rows, self.max_context, dtype=torch.int32, device=d)
        self.free = list(range(1, self.num_slots))
        self.free_rows = list(range(1, self.req_rows))
        self.swa_map = torch.arange(self.num_slots, dtype=torch.int64, device=d) if self.swa_window else None
        self.swa_kv = [[torch.zeros(self.num_slots, self.dim, device=d)] for _ in range(self.halves)] \
            if self.swa_window else None
        self.step = 0

    # ------------------------------------------------------------------ adapter

    def pool_description(self) -> PoolDescription:
        """The pool as kvcanary sees it."""
        groups = [GroupSpec(Group.FULL, self.num_slots, self.halves, reserved_slots=1,
                            sources=[[SourceSpec(t) for t in half] for half in self.kv])]
        if self.swa_window:
            assert self.swa_map is not None and self.swa_kv is not None
            groups.append(GroupSpec(Group.SWA, self.num_slots, self.halves, reserved_slots=1, swa_map=self.swa_map,
                                    window=self.swa_window, sources=[[SourceSpec(t) for t in h] for h in self.swa_kv]))
        return PoolDescription(self.num_slots, self.req_rows, self.max_context, groups, torch.device(self.device),
                               padding_row=self.padding_row)

    def prefix_cache_export(self) -> PrefixCacheExport | None:
        """Cached chains, flattened."""
        d = torch.device(self.device)
        slots, starts, lens = [], [], []
        for c in self.cache:
            starts.append(len(slots))
            lens.append(len(c.slots))
            slots += c.slots
        n = len(self.cache)

        def t(v: list[int]) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.int64, device=d)
        return PrefixCacheExport(t(slots), t(starts), t(lens), t([0] * n), t([NO_SLOT] * n),
                                 torch.tensor([c.locks == 0 for c in self.cache], dtype=torch.bool, device=d))

    # ------------------------------------------------------------------ scheduling

    def add(self, rid: str, prompt: list[int]) -> Req:
        """Admit a request (reusing the longest cached chain that is a strict prefix of the prompt)."""
        row = self.free_rows.pop(0)
        r = Req(rid, row, list(prompt))
        best = None
        for ci, c in enumerate(self.cache):
            if len(c.tokens) < len(prompt) and prompt[:len(c.tokens)] == c.tokens and \
                    (best is None or len(c.tokens) > len(self.cache[best].tokens)):
                best = ci
        if best is not None:
            c = self.cache[best]
            c.locks += 1
            r.cached_from = best
            self.req_to_token[row, :len(c.slots)] = torch.tensor(c.slots, dtype=torch.int32)
            r.kv_len = len(c.slots)
        self.reqs[rid] = r
        return r

    def finish(self, rid: str, cache: bool = True) -> None:
        """Retire a request; its KV becomes a cached chain (or goes back to the free list)."""
        r = self.reqs.pop(rid)
        slots = self.req_to_token[r.row, :r.kv_len].tolist()
        own = slots
        if r.cached_from is not None:
            c = self.cache[r.cached_from]
            c.locks -= 1
            own = slots[len(c.slots):]
        if cache:
            self.cache.append(Chain(slots if r.cached_from is None else slots, r.history[:r.kv_len]))
        else:
            self.free += own
        self.free_rows.append(r.row)

    def batch(self, pad_to: int = 0, rids: list[str] | None = None) -> BatchView:
        """The next forward: prefill for new requests, one decode token for the others."""
        d = torch.device(self.device)
        self.evict_swa()
        rows, pres, exts, ids, poss, locs, names, truth = [], [], [], [], [], [], [], []
        for rid in rids if rids is not None else list(self.reqs):
            r = self.reqs[rid]
            pre = r.kv_len
            ext = len(r.history) - pre
            assert ext >= 1
            new_slots = [self.free.pop(0) for _ in range(ext)]
            self.req_to_token[r.row, pre:pre + ext] = torch.tensor(new_slots, dtype=torch.int32)
            rows.append(r.row)
            pres.append(pre)
            exts.append(ext)
            ids += r.history[pre:]
            poss += list(range(pre, pre + ext))
            locs += new_slots
            names.append(rid)
            truth.append(r.history)
        while len(rows) < pad_to:
            rows.append(self.padding_row)
            pres.append(0)
            exts.append(1)
            ids.append(0)
            poss.append(0)
            locs.append(0)
            names.append(None)
            truth.append([])

        def t(v: list[int]) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.int64, device=d)
        return BatchView(t(rows), t(pres), t(exts), self.req_to_token, t(ids), t(poss), t(locs), names, rows, pres,
                         exts, truth)

    def forward(self, batch: BatchView) -> None:
        """Write the KV of every new token at its out_cache_loc; sample the next token of each request."""
        locs, ids, poss = batch.out_cache_loc.tolist(), batch.input_ids.tolist(), batch.positions.tolist()
        for s, tok, p in zip(locs, ids, poss, strict=True):
            if s < 0:
                continue
            for h in range(self.halves):
                for layer in range(self.layers):
                    self.kv[h][layer][s] = kv_value(tok, p, layer, h, self.dim)
                if self.swa_kv is not None:
                    self.swa_kv[h][0][s] = kv_value(tok, p, 99, h, self.dim)
        for i, rid in enumerate(batch.request_ids):
            if rid is None:
                continue
            r = self.reqs[rid]
            r.kv_len = batch.prefix_lens_host[i] + batch.extend_lens_host[i]
            r.history.append(next_token(rid, len(r.history)))
        self.step += 1

    def evict_swa(self) -> None:
        """Between forwards: SWA slots that fell out of every running request's window leave the SWA pool."""
        if self.swa_map is not None:
            for r in self.reqs.values():
                old = self.req_to_token[r.row, :max(0, r.kv_len - self.swa_window)].long()
                self.swa_map[old] = NO_SLOT


def kv_value(token: int, position: int, layer: int, half: int, dim: int) -> torch.Tensor:
    """Deterministic KV row of a token at a position."""
    x = torch.arange(dim, dtype=torch.float32)
    return torch.sin(x * 0.7 + token * 0.37 + position * 0.11 + layer * 1.3 + half * 2.1)


def next_token(rid: str, n: int) -> int:
    """Deterministic sampled token."""
    return (sum(map(ord, rid)) * 31 + n * 17) % 997 + 3
