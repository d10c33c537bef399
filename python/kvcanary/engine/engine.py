"""The reference paged-KV engine: memory, prefix reuse, chunked prefill, decode, retract, speculation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvcanary.hostcopy import packed

from .batch import ForwardBatch, ForwardMode, PoolKind
from .errors import ConfigError, EngineError, PoolExhaustedError, RequestError
from .faults import IDLE_VICTIM, FaultConfig, FaultInjector
from .hooks import EngineHooks, NullHooks
from .model import ModelConfig, TinyTransformer
from .pool import KVPool, PoolView, ReqToTokenPool, SlotAllocator, SwaMap
from .radix import CachedChains, MatchResult, RadixCache
from .scheduler import ReqState, Request, Scheduler, sample_token


@dataclass(frozen=True)
class EngineConfig:
    """Pool geometry and scheduling knobs.

    `chunk_size` is the prefill token budget of one forward (prompts longer than it are chunked).
    `decode_pad_multiple` > 1 pads decode batches (target and draft) to a multiple of it with rows
    that use `padding_row` and write to reserved slot 0. `spec_num_draft` > 0 enables speculative
    decoding with that many drafted tokens per round (needs a draft model).
    """

    num_slots: int = 1024
    page_size: int = 1
    reserved_slots: int = 1
    padding_row: int | None = 0
    max_reqs: int = 16
    max_context: int = 512
    chunk_size: int = 64
    max_running: int = 8
    num_swa_slots: int = 512
    enable_prefix_cache: bool = True
    mixed_batching: bool = False
    decode_pad_multiple: int = 1
    spec_num_draft: int = 0
    auto_retract: bool = True
    max_steps: int = 100_000

    def __post_init__(self) -> None:
        if self.chunk_size < 1 or self.max_running < 1 or self.decode_pad_multiple < 1:
            raise ConfigError("chunk_size, max_running and decode_pad_multiple must be >= 1")
        if self.spec_num_draft < 0:
            raise ConfigError("spec_num_draft must be >= 0")
        if self.decode_pad_multiple > 1 and (self.reserved_slots < 1 or self.padding_row is None):
            raise ConfigError("padding needs a reserved slot and a padding row")
        if self.spec_num_draft and self.mixed_batching:
            raise ConfigError("mixed batching is not supported with speculative decoding")


@dataclass
class EngineStats:
    """Counters of what the engine did."""

    forwards: int = 0
    draft_forwards: int = 0
    prefix_hit_tokens: int = 0
    retractions: int = 0
    evicted_slots: int = 0
    quarantined_slots: int = 0
    spec_rounds: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    max_batch_size: int = 0
    chunks: int = 0


@dataclass
class _Row:
    """One request's part of a forward under construction."""

    state: ReqState | None
    prefix: int
    inputs: list[int]
    positions: list[int]
    slots: list[int]
    row: int = 0


@dataclass
class _Models:
    """Target and optional draft model with their pools."""

    target: TinyTransformer
    target_pool: KVPool
    draft: TinyTransformer | None = None
    draft_pool: KVPool | None = None


class Engine:
    """A small paged-KV inference engine; see EngineConfig for the knobs."""

    def __init__(self, config: EngineConfig, model: ModelConfig,
                 draft_model: ModelConfig | None = None, device: torch.device | str = "cpu",
                 hooks: EngineHooks | None = None, faults: FaultConfig | None = None) -> None:
        _validate(config, model, draft_model)
        self.config, self.device = config, torch.device(device)
        self.hooks: EngineHooks = hooks if hooks is not None else NullHooks()
        self.faults = FaultInjector(faults)
        self._lenient = faults is not None and any(
            v > 0 for k, v in vars(faults).items() if k != "seed")
        self.stats = EngineStats()
        self.allocator = SlotAllocator(config.num_slots, config.page_size, config.reserved_slots)
        self.req_to_token = ReqToTokenPool(config.max_reqs, config.max_context, self.device,
                                           config.padding_row)
        self.swa = SwaMap(config.num_slots, config.num_swa_slots, config.reserved_slots,
                          self.device) if model.sliding_layers else None
        self.models = _Models(TinyTransformer(model, self.device),
                              KVPool(model, config.num_slots, self.device, self.swa))
        if draft_model is not None:
            self.models.draft = TinyTransformer(draft_model, self.device)
            self.models.draft_pool = KVPool(draft_model, config.num_slots, self.device, None, 1)
        self.radix = RadixCache(config.page_size, self._on_evict) if config.enable_prefix_cache else None
        self.scheduler = Scheduler()

    # ----------------------------------------------------------------- public API
    @property
    def spec(self) -> bool:
        """Whether speculative decoding is on."""
        return self.config.spec_num_draft > 0

    def add_request(self, request: Request) -> None:
        """Queue a request."""
        cfg, model = self.config, self.models.target.config
        if self.scheduler.known(request.rid):
            raise RequestError(f"duplicate request id {request.rid}")
        if any(not 0 <= t < model.vocab_size for t in request.prompt):
            raise RequestError("prompt token out of vocabulary")
        need = len(request.prompt) + request.max_new_tokens + cfg.spec_num_draft + cfg.page_size + 1
        if need > cfg.max_context:
            raise RequestError(f"request needs {need} positions > max_context {cfg.max_context}")
        if -(-need // cfg.page_size) > self.allocator.num_pages:
            raise RequestError("request can never fit in the KV pool")
        self.scheduler.waiting.append(ReqState(request, list(request.prompt)))

    def step(self) -> bool:
        """Run one scheduling step (at most one target forward plus its draft forwards)."""
        if self.radix is not None and self.faults.config.cached_kv_flip_idle > 0:
            idle = [n for n in self.radix.nodes() if n.lock_ref == 0 and n.value.numel()]
            if idle and self.faults.fire_once("cached_kv_flip_idle"):
                self._flip_kv_bit(idle[self.faults.choice(len(idle))].value, last_v_only=False)
                self.faults.kv_victims.append(IDLE_VICTIM)
        self._admit()
        plan = self.scheduler.plan_prefill(self.config.chunk_size)
        if plan:
            decodes = self.scheduler.decoding() if self.config.mixed_batching else []
            self._run_prefill(plan, decodes)
            return True
        decodes = self.scheduler.decoding()
        if not decodes:
            return False
        decodes = self._make_room(decodes)
        if self.spec:
            self._run_spec_round(decodes)
        else:
            self._run_decode(decodes)
        return True

    def run_until_done(self) -> dict[str, list[int]]:
        """Step until every request finished; return outputs by request id."""
        for _ in range(self.config.max_steps):
            if not self.step() and not self.scheduler.running:
                if self.scheduler.waiting:
                    raise PoolExhaustedError("waiting requests cannot be admitted")
                return {rid: s.output() for rid, s in self.scheduler.finished.items()}
        raise EngineError("max_steps exceeded")

    def generate(self, requests: list[Request]) -> dict[str, list[int]]:
        """Add requests, run everything to completion, return the outputs of these requests."""
        for r in requests:
            self.add_request(r)
        done = self.run_until_done()
        return {r.rid: done[r.rid] for r in requests}

    def retract(self, rid: str) -> None:
        """Free a running request's slots (keeping its computed prefix in the cache) and re-queue it."""
        state = self.scheduler.get_running(rid)
        self._release(state)
        self._reset(state)
        self.scheduler.running.remove(state)
        self.scheduler.waiting.appendleft(state)
        self.stats.retractions += 1

    def flush_cache(self) -> None:
        """Evict every unlocked prefix-cache node."""
        if self.radix is not None:
            self.radix.reset()

    def quarantine(self, slots: Sequence[int]) -> int:
        """Never reuse cached KV at ``slots`` (a canary report's quarantine): the prefix-cache runs holding them,
        and everything cached after them, become cache misses and are recomputed; returns the slots freed now."""
        if self.radix is None or not slots:
            return 0
        self.stats.quarantined_slots += len(slots)
        return self.radix.quarantine({int(s) for s in slots})

    def cached_chains(self) -> CachedChains:
        """Vectorized export of the prefix cache for a sweep (empty without a cache)."""
        cache = self.radix or RadixCache(self.config.page_size)
        return cache.export_chains(self.device)

    def resident_chains(self) -> CachedChains:
        """:meth:`cached_chains` plus, per running request, its KV not in the prefix cache (positions
        ``[cached_len, kv_len)`` of its slot-table row, held by it), so a sweep reaches every slot a request holds."""
        tails = [s for s in self.scheduler.running if s.row >= 0 and s.kv_len > s.cached_len]
        if not tails:
            return self.cached_chains()
        base = (self.radix or RadixCache(self.config.page_size)).export_host()
        table = self.req_to_token.table
        t = len(tails)
        rows, first, end = (np.fromiter(v, np.int64, t) for v in
                            ((s.row for s in tails), (s.cached_len for s in tails), (s.kv_len for s in tails)))
        if int(end.max()) > table.shape[1]:
            raise EngineError(f"a running request's kv_len exceeds the slot table's {table.shape[1]} columns")
        lens = end - first
        total, m, c = int(lens.sum()), base.slots.size, base.chain_lens.size
        starts = m + np.cumsum(lens) - lens
        cols = table.shape[1]
        has = (first > 0).astype(np.int64)
        # one host buffer, one copy, one gather (no sync; only kernels the engine itself runs, a kernel's first launch
        # in a process costing milliseconds): the cache's chains, the tails' (their slots and previous slots zero),
        # then the flat table indices of the tails' slots and of each tail's previous slot, whether it has one (1/0)
        # and that minus 1; a tail's previous slot is gathered * has + (has - 1)
        sizes = [m + total, c + t, c + t, c + t, c + t, total + t, t, t]
        ints, unlocked = packed(
            (base.slots, np.zeros(total, np.int64), base.chain_starts, starts, base.chain_lens, lens,
             base.first_positions, first, base.prev_slots, np.zeros(t, np.int64),
             np.repeat(rows * cols + first - (starts - m), lens) + np.arange(total),
             rows * cols + np.maximum(first - 1, 0), has, has - 1),
            np.concatenate([base.unlocked, np.zeros(t, bool)]), table.device)
        slots, chain_starts, chain_lens, first_positions, prev, index, has_d, has_m1 = torch.split(ints, sizes)
        gathered = table.view(-1)[index]
        slots[m:] = gathered[:total]
        torch.mul(gathered[total:], has_d, out=prev[c:]).add_(has_m1)
        return CachedChains(slots, chain_starts, chain_lens, first_positions, prev, unlocked,
                            base.holders + tuple((s.rid,) for s in tails))

    def pool_view(self, kind: PoolKind = PoolKind.TARGET) -> PoolView:
        """Description of the target or draft pool for an integrity checker."""
        pool = self.models.target_pool if kind == PoolKind.TARGET else self.models.draft_pool
        if pool is None:
            raise ConfigError("no draft pool")
        cfg, swa = self.config, pool.swa
        return PoolView(
            num_slots=cfg.num_slots, page_size=cfg.page_size, reserved_slots=cfg.reserved_slots,
            padding_row=cfg.padding_row, full_layers=pool.config.full_layers,
            swa_layers=pool.config.sliding_layers, k=tuple(pool.k), v=tuple(pool.v),
            full_to_swa=swa.device_map if swa else None,
            num_swa_slots=swa.num_swa_slots if swa else 0,
            swa_window=pool.config.sliding_window, token_offset=pool.token_offset,
            req_to_token=self.req_to_token.table)

    def outputs(self) -> dict[str, list[int]]:
        """Outputs of finished requests."""
        return {rid: s.output() for rid, s in self.scheduler.finished.items()}

    # ----------------------------------------------------------------- memory
    def _page_of(self, slots: torch.Tensor) -> list[int]:
        return (slots[::self.config.page_size] // self.config.page_size).tolist()

    def _slot(self, state: ReqState, pos: int) -> int:
        size = self.config.page_size
        return state.pages[pos // size] * size + pos % size

    def _free_pages(self, pages: list[int], front: bool = False, force: bool = False) -> None:
        """Release pages (and their SWA slots) and tell the hooks."""
        if not pages:
            return
        if self._lenient and not force:
            pages = [p for p in pages if not self.allocator.is_free(p)]
        slots = self.allocator.page_slots(pages)
        if self.swa is not None:
            self.swa.release(slots.tolist())
        if force:
            self.allocator.force_free(pages)
        else:
            self.allocator.free(pages, front)
        self.hooks.on_free(slots)  # host ids, as an engine's block manager frees them

    def _on_evict(self, slots: torch.Tensor) -> None:
        self.stats.evicted_slots += int(slots.numel())
        self._free_pages(self._page_of(slots))

    def _take_pages(self, num: int) -> list[int]:
        """Allocate pages, evicting unlocked prefix-cache nodes when needed."""
        pages = self.allocator.alloc(num)
        if pages is None and self.radix is not None:
            short = num - self.allocator.num_free_pages
            self.radix.evict(short * self.config.page_size)
            pages = self.allocator.alloc(num)
        if pages is None:
            raise PoolExhaustedError(f"cannot allocate {num} pages")
        return pages

    def _grow(self, state: ReqState, end: int) -> None:
        """Make the request's pages cover positions [0, end)."""
        size = self.config.page_size
        need = -(-end // size) - len(state.pages)
        if need <= 0:
            return
        pages = self._take_pages(need)
        slots = self.allocator.page_slots(pages)
        self.req_to_token.write(state.row, len(state.pages) * size, slots)
        state.pages.extend(pages)
        self.hooks.on_alloc(slots.to(self.device))

    def _available_pages(self) -> int:
        evictable = self.radix.evictable_slots() // self.config.page_size if self.radix else 0
        return self.allocator.num_free_pages + evictable

    def _assign_swa(self, slots: list[int]) -> None:
        """Give new full slots an SWA slot, evicting cached prefixes when the SWA pool is full."""
        if self.swa is None:
            return
        while not self.swa.assign(slots):
            if self.radix is None or self.radix.evict(self.config.page_size) == 0:
                raise PoolExhaustedError("SWA pool exhausted")

    def _release_window(self, state: ReqState) -> None:
        """Free SWA slots of own positions that left the window of every future query.

        A query at position q attends to [q - window + 1, q], so the last window - 1 prefix positions
        stay resident (a checker verifying `window` positions sees the oldest one as evicted).
        """
        if self.swa is None:
            return
        upto = state.kv_len - self.models.target.config.sliding_window + 1
        lo = max(state.swa_freed_upto, state.cached_len)
        if upto > lo:
            self.swa.release([self._slot(state, p) for p in range(lo, upto)])
            state.swa_freed_upto = upto

    # ----------------------------------------------------------------- admission and release
    def _admit(self) -> None:
        sched, size = self.scheduler, self.config.page_size
        while sched.waiting and len(sched.running) < self.config.max_running:
            state = sched.waiting[0]
            reserve = len(sched.running) * (-(-(self.config.spec_num_draft + 1) // size))
            need = -(-(len(state.tokens) + 1) // size) + reserve
            if self.req_to_token.num_free_rows == 0 or self._available_pages() < need:
                break
            sched.waiting.popleft()
            row = self.req_to_token.alloc()
            state.row = row if row is not None else -1
            self._match(state)
            sched.running.append(state)

    def _match(self, state: ReqState) -> None:
        """Reuse the longest usable cached prefix (locks its node)."""
        if self.radix is None:
            return
        match = self.radix.match(self._radix_key(state.tokens, len(state.tokens) - 1))
        if self.faults.config.wrong_prefix_hit > 0:
            match = self._maybe_wrong_match(state, match)
        size = self.config.page_size
        limit = min(match.length, len(state.tokens) - 1)
        limit = self._swa_usable(match.slots, limit // size * size)
        if limit <= 0:
            return
        if self.faults.fire_once("cached_kv_flip_reused"):
            self._flip_kv_bit(match.slots[:limit], last_v_only=True)
            self.faults.kv_victims.append(state.rid)
        state.cached_len = state.kv_len = state.draft_len = limit
        state.pages = self._page_of(match.slots[:limit])
        self.req_to_token.write(state.row, 0, match.slots[:limit])
        self.radix.lock(match.node, state.rid)
        state.node = match.node
        self.stats.prefix_hit_tokens += limit

    def _flip_kv_bit(self, slots: torch.Tensor, last_v_only: bool) -> None:
        """Fault: flip one low mantissa bit (never NaN/Inf) of one element of the target pool's real KV at one of
        ``slots``: V of the last full-attention layer, or K/V of a random full-attention layer."""
        pool, cfg = self.models.target_pool, self.models.target.config
        full = [i for i in range(cfg.num_layers) if i not in cfg.sliding_layers]
        layer = full[-1] if last_v_only else full[self.faults.choice(len(full))]
        tensors = pool.v if last_v_only or self.faults.choice(2) else pool.k
        row = tensors[layer][int(slots[self.faults.choice(int(slots.numel()))])].view(-1)
        elem = row[self.faults.choice(row.numel()):][:1].view(torch.uint8)  # little-endian: byte 0 is mantissa
        elem[0] ^= 1 << self.faults.choice(7)

    def _maybe_wrong_match(self, state: ReqState, match: MatchResult) -> MatchResult:
        """Fault: return the chain of a node whose key is not a prefix of the request's tokens."""
        if self.radix is None:
            return match
        others, own = [], self._radix_key(state.tokens, len(state.tokens) - 1)
        for node in self.radix.nodes():
            key, slots = self.radix.path(node)
            if tuple(own[:len(key)]) != key:
                others.append(MatchResult(slots, node))
        if not others or not self.faults.fire("wrong_prefix_hit"):
            return match
        return others[self.faults.choice(len(others))]

    def _radix_key(self, tokens: list[int], length: int) -> list[int]:
        """Cache key of the first `length` positions.

        With speculation the key of position p is the bigram (t_p, t_p+1): the draft slot at p holds
        KV computed for t_p+1, so a cached chain may only be reused where the next token agrees too.
        """
        if not self.spec:
            return tokens[:length]
        vocab = self.models.target.config.vocab_size
        return [tokens[p] * vocab + tokens[p + 1] for p in range(length)]

    def _swa_usable(self, slots: torch.Tensor, limit: int) -> int:
        """Longest page-aligned prefix <= limit whose last window - 1 positions are SWA-resident."""
        if self.swa is None or limit <= 0:
            return limit
        window, size = self.models.target.config.sliding_window, self.config.page_size
        resident = self.swa.resident(slots[:limit])
        for usable in range(limit, 0, -size):
            if bool(resident[max(0, usable - window + 1):usable].all()):
                return usable
        return 0

    def _release(self, state: ReqState) -> None:
        """Hand the computed prefix to the cache and free everything else the request holds."""
        size = self.config.page_size
        valid = min(state.kv_len, len(state.tokens) - 1)
        if self.spec:
            valid = min(valid, state.draft_len)
        cut = max(valid // size * size, 0) if self.radix is not None else 0
        tree_from = state.cached_len // size
        if self.radix is not None and cut > 0:
            slots = self.allocator.page_slots(state.pages[:cut // size])
            existing, _ = self.radix.insert(self._radix_key(state.tokens, cut), slots, state.rid)
            first_new = max(existing, state.cached_len) // size
            self._free_pages(state.pages[tree_from:first_new])
            inserted = state.pages[first_new:cut // size]
            if inserted and self.faults.fire("use_after_free"):
                self._free_pages(inserted, front=True, force=True)
            tree_from = max(cut, state.cached_len) // size
        self._free_pages(state.pages[tree_from:])
        if self.radix is not None and state.node is not None:
            self.radix.unlock(state.node)
        if state.row >= 0:
            self.req_to_token.free(state.row)

    @staticmethod
    def _reset(state: ReqState) -> None:
        state.row, state.pages, state.kv_len, state.draft_len = -1, [], 0, 0
        state.cached_len, state.node, state.swa_freed_upto = 0, None, 0
        state.draft_next, state.prefilled = -1, False
        state.retractions += 1

    def _finish_done(self) -> None:
        for state in [s for s in self.scheduler.running if s.remaining <= 0]:
            self._release(state)
            state.row = -1
            self.scheduler.running.remove(state)
            self.scheduler.finished[state.rid] = state

    def _make_room(self, decodes: list[ReqState]) -> list[ReqState]:
        """Retract the newest requests until the next decode round fits in the pool."""
        size, step = self.config.page_size, self.config.spec_num_draft + 1
        while True:
            need = sum(max(0, -(-(max(s.kv_len, s.draft_len) + step) // size) - len(s.pages))
                       for s in decodes)
            if need <= self._available_pages():
                return decodes
            if not self.config.auto_retract or len(self.scheduler.running) <= 1:
                raise PoolExhaustedError("decode does not fit and nothing can be retracted")
            victim = self.scheduler.running[-1]
            self.retract(victim.rid)
            decodes = [s for s in decodes if s is not victim]

    # ----------------------------------------------------------------- forwards
    def _out_slots(self, state: ReqState, positions: list[int]) -> list[int]:
        """Slots the new tokens' KV go to (with the block-boundary and stale out_cache_loc faults applied)."""
        size, out = self.config.page_size, []
        for p in positions:
            stale = self.allocator.next_free_slot()
            if p >= size and p % size == 0 and self.faults.fire("block_boundary_off_by_one"):
                out.append(self._slot(state, p - size))
            elif stale is not None and self.faults.fire("stale_out_cache_loc"):
                out.append(stale)
            else:
                out.append(self._slot(state, p))
        return out

    def _row(self, state: ReqState, prefix: int, inputs: list[int], positions: list[int]) -> _Row:
        return _Row(state, prefix, inputs, positions, self._out_slots(state, positions), state.row)

    def _padding(self, rows: list[_Row], mode: ForwardMode) -> list[_Row]:
        multiple = self.config.decode_pad_multiple
        if mode not in (ForwardMode.DECODE, ForwardMode.DRAFT_DECODE) or multiple <= 1:
            return []
        pads = []
        for _ in range((-len(rows)) % multiple):
            slot = 0
            live = [r.state for r in rows if r.state is not None and r.state.kv_len > 0]
            if live and self.faults.fire("padding_write_live_slot"):
                slot = self._slot(live[self.faults.choice(len(live))], 0)
            pads.append(_Row(None, 0, [0], [0], [slot], self.config.padding_row or 0))
        return pads

    def _build(self, rows: list[_Row], mode: ForwardMode, kind: PoolKind) -> ForwardBatch:
        all_rows = rows + self._padding(rows, mode)

        def dev(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)

        pool = self.models.target_pool if kind == PoolKind.TARGET else self.models.draft_pool
        self.stats.max_batch_size = max(self.stats.max_batch_size, len(rows))
        return ForwardBatch(
            mode=mode, pool_kind=kind, token_offset=pool.token_offset if pool else 0,
            req_ids=tuple(r.state.rid for r in rows if r.state is not None),
            req_pool_indices=dev([r.row for r in all_rows]),
            prefix_lens=dev([r.prefix for r in all_rows]),
            extend_lens=dev([len(r.inputs) for r in all_rows]),
            req_to_token=self.req_to_token.table,
            input_ids=dev([t for r in all_rows for t in r.inputs]),
            positions=dev([p for r in all_rows for p in r.positions]),
            out_cache_loc=dev([s for r in all_rows for s in r.slots]),
            histories=tuple(tuple(r.state.tokens) for r in rows if r.state is not None),
            num_padding=len(all_rows) - len(rows),
            req_pool_indices_host=tuple(r.row for r in all_rows),
            prefix_lens_host=tuple(r.prefix for r in all_rows),
            extend_lens_host=tuple(len(r.inputs) for r in all_rows))

    def _forward(self, rows: list[_Row], mode: ForwardMode, kind: PoolKind) -> torch.Tensor:
        """Build the batch, run the model between the hooks, return the logits (CPU, per token)."""
        new_slots = [s for r in rows for s in r.slots]
        if kind == PoolKind.TARGET:
            self._assign_swa(new_slots)
        batch = self._build(rows, mode, kind)
        model = self.models.target if kind == PoolKind.TARGET else self.models.draft
        pool = self.models.target_pool if kind == PoolKind.TARGET else self.models.draft_pool
        if model is None or pool is None:
            raise ConfigError("no draft model")
        self.hooks.before_forward(batch, kind)
        logits = model.forward(batch, pool)
        self.hooks.after_forward(batch, kind)
        if kind == PoolKind.TARGET:
            self.stats.forwards += 1
        else:
            self.stats.draft_forwards += 1
        return logits.float().cpu()

    def _run_prefill(self, plan: list[tuple[ReqState, int]], decodes: list[ReqState]) -> None:
        """One extend forward over the next chunk of every planned request (plus mixed decodes)."""
        rows, ends = self._prefill_rows(plan + [(s, s.kv_len + 1) for s in decodes])
        if not rows:
            return
        logits = self._forward(rows, ForwardMode.EXTEND, PoolKind.TARGET)
        self.stats.chunks += 1
        last, predicted = -1, []
        for row, end in zip(rows, ends, strict=False):
            last += len(row.inputs)
            predicted.append(int(torch.argmax(logits[last])))
            self._end_chunk(_state(row), end, logits[last])
        if self.spec:
            self._draft_after_prefill(rows, predicted)
        self._finish_done()

    def _prefill_rows(self, plan: list[tuple[ReqState, int]]) -> tuple[list[_Row], list[int]]:
        """Allocate each planned chunk (retracting a request that does not fit) and build its row."""
        rows, ends = [], []
        for state, end in plan:
            try:
                self._grow(state, end)
            except PoolExhaustedError:
                if len(self.scheduler.running) <= 1 or not self.config.auto_retract:
                    raise
                self.retract(state.rid)
                continue
            start = state.kv_len
            rows.append(self._row(state, start, state.tokens[start:end], list(range(start, end))))
            ends.append(end)
        return rows, ends

    def _end_chunk(self, state: ReqState, end: int, last_logits: torch.Tensor) -> None:
        """Advance the KV length; after the final chunk sample the next token."""
        state.kv_len = end
        if end == len(state.tokens):
            token = sample_token(last_logits, state.req.sampling, state.num_outputs)
            state.tokens.append(token)
            state.prefilled = True
        self._release_window(state)

    def _run_decode(self, decodes: list[ReqState]) -> None:
        """One decode forward: every request feeds its last token."""
        rows = []
        for state in decodes:
            self._grow(state, state.kv_len + 1)
            rows.append(self._row(state, state.kv_len, [state.tokens[-1]], [state.kv_len]))
        logits = self._forward(rows, ForwardMode.DECODE, PoolKind.TARGET)
        for i, state in enumerate(decodes):
            state.kv_len += 1
            state.tokens.append(sample_token(logits[i], state.req.sampling, state.num_outputs))
            self._release_window(state)
        self._finish_done()

    # ----------------------------------------------------------------- speculative decoding
    def _draft_next_token(self, state: ReqState, end: int, predicted: int) -> int:
        """Token at position `end` for the draft's chunk (its last input), with the SGLang bugs."""
        if state.prefilled:
            return state.tokens[end]
        if self.faults.fire("draft_chunk_predicted_token"):
            return predicted
        prompt = state.req.prompt
        if end >= len(prompt) and self.faults.fire("resume_prompt_only_lookup"):
            return predicted
        return state.tokens[end]

    def _draft_after_prefill(self, rows: list[_Row], predicted: list[int]) -> None:
        """Draft extend over the chunk just prefilled (its inputs rotated by one token)."""
        drows = []
        for row, pred in zip(rows, predicted, strict=False):
            state = row.state
            if state is None:
                continue
            end = state.kv_len
            start = state.draft_len
            nxt = self._draft_next_token(state, end, pred)
            inputs = state.tokens[start + 1:end] + [nxt]
            drows.append(self._row(state, start, inputs, list(range(start, end))))
        logits = self._forward(drows, ForwardMode.DRAFT_EXTEND, PoolKind.DRAFT)
        last = -1
        for row in drows:
            if row.state is None:
                continue
            last += len(row.inputs)
            row.state.draft_len = row.state.kv_len
            if row.state.prefilled:
                row.state.draft_next = int(torch.argmax(logits[last]))

    def _run_spec_round(self, decodes: list[ReqState]) -> None:
        """Draft k tokens, verify them in one target extend, roll back the rejected slots."""
        k = self.config.spec_num_draft
        for state in decodes:
            self._grow(state, max(state.kv_len, state.draft_len) + k + 1)
        drafts = self._draft_proposals(decodes, k)
        rows = [self._row(s, s.kv_len, [s.tokens[-1]] + drafts[i],
                          list(range(s.kv_len, s.kv_len + k + 1))) for i, s in enumerate(decodes)]
        logits = self._forward(rows, ForwardMode.TARGET_VERIFY, PoolKind.TARGET)
        self.stats.spec_rounds += 1
        for i, state in enumerate(decodes):
            self._accept(state, drafts[i], logits[i * (k + 1):(i + 1) * (k + 1)])
        self._draft_catch_up([s for s in decodes if s.remaining > 0])
        for state in decodes:
            self._release_window(state)
        self._finish_done()

    def _draft_proposals(self, decodes: list[ReqState], k: int) -> list[list[int]]:
        """k-1 draft decode forwards; proposal 0 comes from the previous draft forward."""
        drafts = [[s.draft_next] for s in decodes]
        for _ in range(k - 1):
            rows = []
            for i, s in enumerate(decodes):
                pos = s.draft_len + (1 if self.faults.fire("draft_position_off_by_one") else 0)
                slots = self._out_slots(s, [s.draft_len])
                rows.append(_Row(s, s.draft_len, [drafts[i][-1]], [pos], slots, s.row))
            logits = self._forward(rows, ForwardMode.DRAFT_DECODE, PoolKind.DRAFT)
            for i, s in enumerate(decodes):
                s.draft_len += 1
                drafts[i].append(int(torch.argmax(logits[i])))
        return drafts

    def _accept(self, state: ReqState, drafts: list[int], logits: torch.Tensor) -> None:
        """Greedy-match acceptance, then roll back target length, draft length and pages."""
        k, new = len(drafts), list[int]()
        for i in range(k + 1):
            token = sample_token(logits[i], state.req.sampling, state.num_outputs + len(new))
            new.append(token)
            if len(new) >= state.remaining or (i < k and drafts[i] != token):
                break
        self.stats.spec_proposed += k
        self.stats.spec_accepted += len(new) - 1
        kv_old = state.kv_len
        state.tokens.extend(new)
        state.kv_len = kv_old + len(new)
        if len(new) <= k and self.faults.fire("trimmed_tail_still_read"):
            state.kv_len = kv_old + k + 1
        bound = len(state.tokens) - 2
        if state.draft_len > bound and self.faults.fire("spec_stale_draft"):
            bound += 1
        state.draft_len = min(state.draft_len, bound)
        self._rollback_pages(state)

    def _rollback_pages(self, state: ReqState) -> None:
        """Free pages past everything still needed (rejected target and draft slots)."""
        size = self.config.page_size
        keep = -(-max(state.kv_len, state.draft_len, len(state.tokens) - 1) // size)
        extra = state.pages[keep:]
        if not extra:
            return
        if keep >= 1 and self.faults.fire("spec_rollback_wrong_slots"):
            self._free_pages(state.pages[keep - 1:len(state.pages) - 1])
        else:
            self._free_pages(extra)
        del state.pages[keep:]

    def _draft_catch_up(self, decodes: list[ReqState]) -> None:
        """Draft extend over committed tokens the draft has not seen (bonus and corrected ones)."""
        rows = []
        for s in decodes:
            end = len(s.tokens) - 1
            if s.draft_len >= end:
                s.draft_next = s.tokens[-1]
                continue
            inputs = s.tokens[s.draft_len + 1:end + 1]
            rows.append(self._row(s, s.draft_len, inputs, list(range(s.draft_len, end))))
        if not rows:
            return
        logits = self._forward(rows, ForwardMode.DRAFT_EXTEND, PoolKind.DRAFT)
        last = -1
        for row in rows:
            if row.state is None:
                continue
            last += len(row.inputs)
            row.state.draft_len = len(row.state.tokens) - 1
            row.state.draft_next = int(torch.argmax(logits[last]))


def _state(row: _Row) -> ReqState:
    """The request of a non-padding row."""
    if row.state is None:
        raise EngineError("padding row where a request row was expected")
    return row.state


def _validate(config: EngineConfig, model: ModelConfig, draft: ModelConfig | None) -> None:
    """Cross-check engine and model configs."""
    if config.spec_num_draft and draft is None:
        raise ConfigError("speculative decoding needs a draft model")
    if draft is not None:
        if draft.sliding_layers:
            raise ConfigError("the draft model must not have sliding layers")
        if draft.vocab_size != model.vocab_size:
            raise ConfigError("draft and target vocabularies differ")
