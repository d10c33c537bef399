"""kvcanary inside Hugging Face transformers 5.23.0 continuous batching (sdpa paged cache), via its choke points."""

from __future__ import annotations

import logging
import operator
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, cast, overload

import numpy as np
import torch
from kvcanary_schema import DEFAULT_REQ_CAPACITY, NO_SLOT, Group

from kvcanary.adapter import BatchView, GroupSpec, PoolDescription, PrefixCacheExport, copy_transfer
from kvcanary.config import CanaryConfig, CanaryMode
from kvcanary.errors import CanaryInputError, KVCanaryError
from kvcanary.hostcopy import export_of_blocks
from kvcanary.manager import CanaryManager
from kvcanary.manager import install as install_manager
from kvcanary.ops.slot_rows import SlotRowStager
from kvcanary.ops.types import SourceSpec
from kvcanary.report import ReportSink, Violation, WindowReport
from kvcanary.streams import StreamSwitch, Was
from kvcanary.truth import new_token_truth

logger = logging.getLogger("kvcanary")

SUPPORTED_VERSION = "5.23.0"
_FULL = "full_attention"
_SUPPORTED_ATTN = ("sdpa", "paged|eager")
# (module under transformers.generation.continuous_batching, class, methods): checked at install time
_REQUIRED = (
    ("continuous_api", "ContinuousBatchingManager", ("_create_batch_processor", "get_result", "stop", "is_running")),
    ("continuous_api", "ContinuousBatchProcessor", ("_generation_step",)),
    ("input_outputs", "ContinuousBatchingIOs", ("prepare_batch_tensors",)),
    ("cache", "PagedAttentionCache", ("search_prefix_match", "evict_cached_blocks", "reset")),
    ("cache_allocators.full_attention", "FullAttentionCacheAllocator",
     ("update", "free_blocks", "mark_complete_blocks", "copy_blocks", "get_read_indices")),
)


# the stats keys of kvcanary's own host time on the generation thread (TransformersCanary.host_us)
HOST_TIME_KEYS = ("bracket_us", "snapshot_us", "lifecycle_us")
# calls of prefix_cache_export that may hand out an export lacking the blocks hashed since it was built (rolling sweep:
# one call per slice, so new blocks join it within this many slices plus one; the rebuild and the sweep's derive from
# it cost 0.5-0.8 ms of host time per call on an H100 host: bench/results/host_session23)
EXPORT_REUSES = 3
# forwards between two KV-write checks of a batch shape that passed (its first forward is always checked)
WRITE_CHECK_INTERVAL = 64
MAX_WRITE_SHAPES = 4096  # batch shapes remembered as checked


class TransformersIntegrationError(KVCanaryError, RuntimeError):
    """transformers is missing, of another version, or configured in a way kvcanary cannot guard."""


def _check_transformers() -> Any:
    """Import transformers and check the pinned version and every wrapped symbol; returns the continuous_api module."""
    try:
        import importlib

        import transformers
    except ImportError as e:  # pragma: no cover - the tests skip without transformers
        raise TransformersIntegrationError("kvcanary.integrations.transformers needs transformers==5.23.0 "
                                           "(pip install 'kvcanary[transformers]')") from e
    if transformers.__version__ != SUPPORTED_VERSION:
        raise TransformersIntegrationError(
            f"kvcanary supports transformers=={SUPPORTED_VERSION} exactly (its paged-cache internals change between "
            f"releases); found {transformers.__version__}")
    base = "transformers.generation.continuous_batching."
    for mod, cls, methods in _REQUIRED:
        klass = getattr(importlib.import_module(base + mod), cls, None)
        missing = [m for m in methods if not callable(getattr(klass, m, None))]
        if klass is None or missing:
            raise TransformersIntegrationError(f"transformers {transformers.__version__}: {cls} lacks {missing or cls}")
    return importlib.import_module(base + "continuous_api")


class _Patches:
    """Instance-attribute wrappers, restored exactly (the previous instance attribute, or none) in reverse order."""

    def __init__(self) -> None:
        self._saved: list[tuple[object, str, bool, Any]] = []

    def wrap(self, obj: object, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        """Replace ``obj.name`` by ``make(current bound callable)``."""
        current = getattr(obj, name)
        if getattr(current, "__kvcanary__", False):
            raise TransformersIntegrationError(f"kvcanary is already installed on this {type(obj).__name__} "
                                               "(uninstall the other handle first)")
        own = vars(obj)
        had = name in own
        wrapper = make(current)
        wrapper.__kvcanary__ = True  # type: ignore[attr-defined]
        self._saved.append((obj, name, had, own.get(name)))
        setattr(obj, name, wrapper)

    def restore(self) -> None:
        """Undo every wrap, newest first."""
        while self._saved:
            obj, name, had, prev = self._saved.pop()
            if had:
                setattr(obj, name, prev)
            elif name in vars(obj):
                delattr(obj, name)

    def __len__(self) -> int:
        return len(self._saved)


class _History(Sequence[int]):
    """A request's true tokens (prompt + generated) as one sequence, without copying either list."""

    __slots__ = ("_a", "_b")

    def __init__(self, a: Sequence[int], b: Sequence[int]) -> None:
        self._a, self._b = a, b

    def __len__(self) -> int:
        return len(self._a) + len(self._b)

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[int]: ...

    def __getitem__(self, i: int | slice) -> int | Sequence[int]:
        na = len(self._a)
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return [self[k] for k in range(start, stop, step)]
            if stop <= na:
                return list(self._a[start:stop])
            if start >= na:
                return list(self._b[start - na:stop - na])
            return list(self._a[start:]) + list(self._b[:stop - na])
        k = i + len(self) if i < 0 else i
        return self._a[k] if k < na else self._b[k - na]


class _Histories(Sequence[Sequence[int]]):
    """The batch's true tokens: each request's :class:`_History`, made when asked for (a steady forward asks for
    none)."""

    __slots__ = ("_states",)

    def __init__(self, states: Sequence[Any]) -> None:
        self._states = states

    def __len__(self) -> int:
        return len(self._states)

    @overload
    def __getitem__(self, i: int) -> Sequence[int]: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[Sequence[int]]: ...

    def __getitem__(self, i: int | slice) -> Sequence[int] | Sequence[Sequence[int]]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        s = self._states[i]
        return _History(s.initial_tokens, s.generated_tokens)


@dataclass(frozen=True)
class _Batch:
    """A batch as prepare_batch_tensors found it (before it advanced the requests), as parallel lists: ids, transformers
    RequestStates, prefix lengths (the requests' position offsets) and extend lengths (their query lengths)."""

    ids: list[str]
    states: list[Any]
    pre: list[int]
    ext: list[int]

    @classmethod
    def of(cls, scheduled: Sequence[Any]) -> _Batch:
        """The batch of prepare_batch_tensors' ``requests_in_batch`` (FutureRequestStates)."""
        states = [fs.state for fs in scheduled]
        return cls([s.request_id for s in states], states, list(map(int, (s.position_offset for s in states))),
                   list(map(int, (fs.query_length for fs in scheduled))))

    def new_tokens(self, n: int) -> np.ndarray:
        """BatchView.true_new_tokens (:func:`~kvcanary.truth.new_token_truth` of the histories): a decode batch's one
        token per request is read from its state's lists, no history made."""
        if self.ext.count(1) != len(self.ext) or len(self.ext) > n:  # not one new token per request: the general fold
            return new_token_truth(_Histories(self.states), self.pre, self.ext, n)
        toks = [_token_at(s.initial_tokens, s.generated_tokens, p) for s, p in zip(self.states, self.pre, strict=True)]
        return np.array(toks + [-1] * (n - len(toks)), dtype=np.int64)  # one numpy call: each costs microseconds


def _token_at(prompt: Sequence[int], generated: Sequence[int], p: int) -> int:
    """The true token at position ``p`` >= 0 of a request (its prompt, then its generated tokens); -1 past their end."""
    k = p - len(prompt)
    return prompt[p] if k < 0 else generated[k] if k < len(generated) else -1


@dataclass(frozen=True)
class _Export:
    """The adapter's last export: the lifecycle key it was handed out under, the adapter's ``losses`` when it was
    built, and how many calls have handed it out since the cache changed."""

    key: tuple[int, int, int]
    losses: int
    export: PrefixCacheExport
    reuses: int = 0

    def reused(self, key: tuple[int, int, int]) -> _Export:
        """The same export, handed out once more under ``key``."""
        return _Export(key, self.losses, self.export, self.reuses + 1)


class HFPoolAdapter:
    """The kvcanary engine adapter over one ``PagedAttentionCache`` (full-attention group only).

    Slots are *dense*: ``block_id * page_size + offset``. transformers addresses a token by the sparse row
    ``block_id * block_physical_stride + offset`` (every layer's K and V live in one block), so the dense id space
    is ``block_physical_stride / page_size`` times smaller. Block ids below two sectors are transformers' trash
    sectors (padding reads and writes): reserved, never verified.
    """

    def __init__(self, cache: Any, req_rows: int | None = None, max_context: int | None = None,
                 max_position_embeddings: int | None = None, req_capacity: int = DEFAULT_REQ_CAPACITY,
                 backend: str = "torch") -> None:
        if list(cache.cache_allocators) != [_FULL]:
            raise TransformersIntegrationError(f"kvcanary guards full-attention-only models; this cache has groups "
                                               f"{list(cache.cache_allocators)}")
        alloc = cache.cache_allocators[_FULL]
        self.cache, self.alloc = cache, alloc
        self.page = int(alloc.tokens_per_page)
        self.stride = int(alloc.block_physical_stride)
        bps = int(alloc.blocks_per_sector)
        self.total_blocks = (int(cache.num_sectors) + 2) * bps
        self.num_slots = self.total_blocks * self.page
        self.reserved_slots = 2 * bps * self.page
        self.device = torch.device(cache.device)
        self.backend = backend  # the canary's
        self.num_layers = len(alloc.layer_indices)
        usable = self.num_slots - self.reserved_slots
        # every live request owns at least one block of its own (a prefix hit never covers its last token)
        self.req_rows = req_rows if req_rows is not None else max(1, min(self.total_blocks - 2 * bps, req_capacity))
        self.max_context = max_context if max_context is not None else min(usable, max_position_embeddings or usable)
        if self.req_rows < 1 or self.max_context < 1:
            raise CanaryInputError(f"req_rows and max_context must be >= 1, got {self.req_rows}, {self.max_context}")
        dtype = torch.int32 if self.num_slots < 2**31 else torch.int64
        table_bytes = self.req_rows * self.max_context * dtype.itemsize
        if table_bytes > 1 << 28:
            logger.warning("kvcanary: the slot table takes %d MiB (%d rows x %d positions); pass req_rows= and "
                           "max_context= to install() to shrink it", table_bytes >> 20, self.req_rows, self.max_context)
        self.req_to_token = torch.full((self.req_rows, self.max_context), NO_SLOT, dtype=dtype, device=self.device)
        # the batch view's per-forward buffers: its row facts staged with the slot rows' fill in one call, its converted
        # write slots (grown on demand)
        self._stage_rows = SlotRowStager(self.req_to_token, self.stride, self.page, self.req_rows, backend)
        self._out = torch.empty(0, dtype=torch.int64, device=self.device)
        # _views: the buffers its views are of, and the views by token count
        self._view_bases: tuple[torch.Tensor | None, ...] = (None,) * 5
        self._view_cache: dict[int, tuple[torch.Tensor, ...]] = {}
        self._read_row = torch.zeros(0, dtype=torch.int64)  # the read index's group-0 row (_views)
        self._rows: dict[str, int] = {}
        self._free_rows = list(range(self.req_rows - 1, -1, -1))
        # the hashed blocks recorded (the ledger keeps neither positions nor parents): per block its content hash, and
        # by block id its first position, its parent (-1: none) and whether it is recorded, so the export is built
        # with array operations
        self._hashes: dict[int, int] = {}
        self._first = np.zeros(self.total_blocks, dtype=np.int64)
        self._parent = np.full(self.total_blocks, -1, dtype=np.int64)
        self._recorded = np.zeros(self.total_blocks, dtype=bool)
        self._hashed_upto: dict[str, int] = {}  # request -> leading blocks of its table already recorded
        # the export of the last sweep and what it was built from: the block lifecycle calls touch(), so an unchanged
        # cache hands the sweep the same (immutable) export object again; one that only gained blocks since, for up
        # to EXPORT_REUSES calls (prefix_cache_export)
        self.version = 0
        self.losses = 0  # forget_hashes calls that dropped a recorded block
        self._export: _Export | None = None
        self._warned_fallback = False

    # ------------------------------------------------------------------ pool description

    def sources(self) -> list[list[SourceSpec]]:
        """Per half (K, V), one byte-row source per layer: row = block, ``page_size`` tokens of ``row_bytes`` each."""
        alloc = self.alloc
        row_bytes = int(alloc.num_key_value_heads) * int(alloc.head_dim) * alloc.cache_dtype.itemsize
        block_bytes = int(alloc.bytes_per_block)
        flat = self.cache.cache_tensor
        expected = 2 * self.num_layers * self.page * row_bytes
        if flat.numel() != self.total_blocks * block_bytes or block_bytes != expected:
            raise TransformersIntegrationError(f"unexpected pool layout: {flat.numel()} bytes for {self.total_blocks} "
                                               f"blocks of {block_bytes} bytes ({self.num_layers} layers, page "
                                               f"{self.page}, row {row_bytes} bytes)")
        blocks = flat.view(self.total_blocks, block_bytes)
        span = self.page * row_bytes
        return [[SourceSpec(blocks[:, (2 * i + h) * span:(2 * i + h + 1) * span], self.page, row_bytes)
                 for i in range(self.num_layers)] for h in (0, 1)]

    def pool_description(self) -> PoolDescription:
        """The pool as kvcanary sees it (one FULL group, K and V, every layer a fingerprint source)."""
        group = GroupSpec(Group.FULL, self.num_slots, 2, self.reserved_slots, sources=self.sources())
        return PoolDescription(self.num_slots, self.req_rows, self.max_context, [group], self.device, self.page)

    # ------------------------------------------------------------------ slots and rows

    def row(self, request_id: str) -> int:
        """The request's row of req_to_token (assigned on first sight, freed when its blocks are freed)."""
        r = self._rows.get(request_id)
        if r is None:
            if not self._free_rows:
                raise CanaryInputError(f"more than req_rows={self.req_rows} live requests; install(..., req_rows=N)")
            r = self._rows[request_id] = self._free_rows.pop()
        return r

    def release(self, request_id: str) -> bool:
        """Forget a request whose blocks were freed; True when it had a row."""
        self._hashed_upto.pop(request_id, None)
        r = self._rows.pop(request_id, None)
        if r is None:
            return False
        self._free_rows.append(r)
        return True

    @property
    def live_requests(self) -> int:
        """Requests holding a row."""
        return len(self._rows)

    # ------------------------------------------------------------------ batch view

    def batch_view(self, io: Any, batch: _Batch) -> BatchView:
        """The forward's batch view: the slot table is what the attention reads (``read_index``), the write slots
        what it writes (``write_index``), both converted to dense slots. The rows are rebuilt from the read index every
        forward, so the canary verifies exactly what the attention reads: one ``stage_slot_rows`` call
        (docs/ops-contract.md 12a) stages the row facts, fills the rows and converts the write slots."""
        ids, pre, ext = batch.ids, batch.pre, batch.ext
        known = list(map(self._rows.get, ids))
        # a request seen for the first time gets its row
        rows = [self.row(i) for i in ids] if None in known else cast(list[int], known)
        bs, n = len(ids), int(io.total_seqlen_q)
        # the facts of a few dozen requests: builtins on the lists, one conversion (numpy calls cost more each)
        kv = list(map(operator.add, pre, ext))
        if bs and max(kv) > self.max_context:  # the plan would skip it: its blocks would never get records
            i = kv.index(max(kv))
            raise CanaryInputError(f"request {ids[i]!r} reaches {kv[i]} positions, past the slot table's "
                                   f"max_context={self.max_context} (the model's max_position_embeddings unless "
                                   "install(..., max_context=N))")
        total = sum(kv)
        facts = np.array((rows, pre, ext), dtype=np.int64)  # the facts as arrays: no conversion in begin
        write, input_ids, positions, out = self._views(io, n)
        src = self._read_slots(io, batch, total, write) if total else write[:0]
        dev_rows, dev_pre, dev_ext = self._stage_rows(facts, src, out, write)
        return BatchView(dev_rows, dev_pre, dev_ext, self.req_to_token, input_ids, positions, out,
                         ids, facts[0], facts[1], facts[2], _Histories(batch.states),
                         true_new_tokens=batch.new_tokens(n))

    def _views(self, io: Any, n: int) -> tuple[torch.Tensor, ...]:
        """The forward's ``n`` write-index entries, input ids and positions (views of transformers' persistent
        buffers) and converted write slots (the front of one buffer of the canary's, kept across forwards: each
        forward's slot_rows, stage copy and plan are queued before the next one's conversion overwrites it). The views
        are made once per ``n`` while those buffers stay the same objects: each costs microseconds every forward. The
        read index's row (:meth:`_read_slots`) is made once per buffer too."""
        if self._out.shape[0] < n:
            self._out = torch.empty(max(n, 2 * self._out.shape[0]), dtype=torch.int64, device=self.device)
        bases = (io.write_index_storage, io.input_ids, io.position_ids, self._out, io.read_index_storage)
        if not all(map(operator.is_, bases, self._view_bases)):
            self._view_bases, self._view_cache, self._read_row = bases, {}, bases[4][0]
        views = self._view_cache.get(n)
        if views is None:
            views = self._view_cache[n] = (bases[0][0, :n], bases[1][:n], bases[2][:n], bases[3][:n])
        return views

    def _read_slots(self, io: Any, batch: _Batch, total: int, write: torch.Tensor) -> torch.Tensor:
        """Sparse slots of positions 0..prefix+extend-1 of every request, in batch order, then possibly stale entries
        that no request's segment reaches (what the attention reads; ``write``: the forward's write-index entries)."""
        if int(io.true_read_sizes[0]) == total:
            return self._read_row  # its first `total` entries: no view made per forward
        if int(io.true_read_sizes[0]) == 0 and total == write.shape[0]:  # no request reads cache: no prefix
            return write
        if not self._warned_fallback:
            self._warned_fallback = True
            logger.warning("kvcanary: read index of %d slots for %d positions; rebuilding the slot table from the "
                           "block tables", int(io.true_read_sizes[0]), total)
        flat = [s for i, p, e in zip(batch.ids, batch.pre, batch.ext, strict=True)
                for s in self.alloc.get_read_indices(i, p, e)]
        return torch.tensor(flat, dtype=torch.int64, device=self.device)

    # ------------------------------------------------------------------ prefix cache (sweep)

    def on_blocks_hashed(self, request_id: str) -> None:
        """Record (first position, parent block) of the request's newly hashed blocks; the ledger keeps neither."""
        bt = self.alloc.block_table.get(request_id)
        if not bt:
            return
        b2h = self.alloc.ledger.block_to_hash
        i = self._hashed_upto.get(request_id, 0)
        while i < len(bt):
            h = b2h.get(bt[i])
            if h is None:
                break
            b = bt[i]
            if self._hashes.get(b) != h:
                self._hashes[b] = h
                self._first[b], self._parent[b], self._recorded[b] = i * self.page, bt[i - 1] if i else -1, True
            i += 1
        self._hashed_upto[request_id] = i

    def forget_hashes(self) -> None:
        """Drop every recorded block whose hash the ledger no longer holds."""
        b2h = self.alloc.ledger.block_to_hash
        gone = [b for b, h in self._hashes.items() if b2h.get(b) != h]
        for b in gone:
            del self._hashes[b]
        self._recorded[gone] = False
        self.losses += bool(gone)

    def touch(self) -> None:
        """The block lifecycle changed something the export holds (hashes, cached blocks)."""
        self.version += 1

    def prefix_cache_export(self) -> PrefixCacheExport | None:
        """Every hashed block (live or cached) as a chain of ``page_size`` slots; ``unlocked`` = cached.

        The same object while the lifecycle touched nothing and the ledger's sizes held. After a change that dropped
        no block from the cache, the same object for up to :data:`EXPORT_REUSES` more calls: it lacks the blocks
        hashed since (a sweep verifies them once a rebuild takes them in), and every chain it holds still holds the
        tokens it held. A dropped block (eviction, no-cache free, reset) forces a rebuild at once: its slots may hold
        other tokens by now. So a busy cache, which hashes a block nearly every forward, is rebuilt every
        ``EXPORT_REUSES + 1``-th call, not every call."""
        ledger = self.alloc.ledger
        key = (self.version, len(ledger.block_to_hash), len(ledger.cached_blocks))
        e = self._export
        if e is not None and e.key != key:
            # every loss the ledger can make goes through forget_hashes (the wrappers call it); a count that differs
            # from the recorded one means a path this integration does not see: rebuild
            gained_only = e.losses == self.losses and len(self._hashes) == len(ledger.block_to_hash)
            e = e.reused(key) if gained_only and e.reuses < EXPORT_REUSES else None
        if e is None:
            export = self._build_export()  # may forget hashes first: the losses it counts are in this build
            e = _Export(key, self.losses, export)
        self._export = e
        return e.export

    def _build_export(self) -> PrefixCacheExport:
        """The hashed blocks whose parent is hashed too, in block order, built on the host and moved in one copy (no
        stream sync)."""
        ledger = self.alloc.ledger
        # the ledger drops hashes only where the wrappers forget them (eviction, reset, a no-cache free), and every
        # hash it registers is recorded: a count that differs means a path this integration does not see
        if len(self._hashes) != len(ledger.block_to_hash):
            self.forget_hashes()
        rec = self._recorded
        blocks = np.flatnonzero(rec)
        parents = self._parent[blocks]
        keep = (parents < 0) | rec[np.maximum(parents, 0)]
        blocks, parents = blocks[keep], parents[keep]
        unlocked = np.zeros(rec.shape[0], dtype=bool)
        if ledger.cached_blocks:
            unlocked[np.fromiter(ledger.cached_blocks, dtype=np.int64, count=len(ledger.cached_blocks))] = True
        return export_of_blocks(blocks, self._first[blocks], parents, self.page, unlocked[blocks], self.device)

    def copy_records(self, canary: CanaryManager, src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> None:
        """A fork copied whole blocks: copy their canary records along."""
        buffers = canary.transfer_buffers()
        if not buffers or not src_blocks:
            return
        ar = torch.arange(self.page, device=self.device)

        def slots(blocks: Sequence[int]) -> torch.Tensor:
            return (torch.tensor(list(blocks), dtype=torch.int64, device=self.device).unsqueeze(1) * self.page
                    + ar).reshape(-1)
        copy_transfer(buffers, slots(src_blocks), buffers, slots(dst_blocks))


class _Session:
    """The canary of one ContinuousBatchProcessor (one PagedAttentionCache) and its wrappers."""

    def __init__(self, handle: TransformersCanary, hf_manager: Any, proc: Any) -> None:
        self.handle, self.hf_manager, self.proc = handle, hf_manager, proc
        cache = proc.cache
        text_cfg = hf_manager.model.config.get_text_config()
        self.adapter = HFPoolAdapter(cache, handle.req_rows, handle.max_context,
                                     getattr(text_cfg, "max_position_embeddings", None), handle.config.req_capacity,
                                     handle.config.resolved_backend(torch.device(cache.device).type))
        self.canary: CanaryManager = install_manager(self.adapter, handle.config,
                                                     sinks=[handle._on_report, *handle.sinks])
        self.graphs = any(hf_manager.continuous_batching_config.cuda_graph_booleans)
        self.pending: _Batch | None = None
        self.in_forward = False
        self.disabled = False  # LOG mode, after an internal failure
        self.hf_failed = self.ran_hf = False
        self.layer_writes = 0
        self.stray_writes = 0
        self.write_ptr = 0
        self._switch: StreamSwitch | None = None  # to transformers' compute stream (_enter)
        self.stats: Counter[str] = Counter()
        self.patches = _Patches()
        alloc = self.adapter.alloc
        p = self.patches
        p.wrap(proc, "_generation_step", self._wrap_step)
        p.wrap(proc.inputs_and_outputs, "prepare_batch_tensors", self._wrap_prepare)
        # the KV-write hook, installed only on the forwards that check their writes (_arm_write_check)
        self._unhooked: Callable[..., Any] = alloc.update
        p.wrap(alloc, "update", self._wrap_update)
        self._hook, self._hooked = alloc.update, True
        self._write_shapes: set[tuple[int, int]] = set()
        p.wrap(alloc, "free_blocks", self._lifecycle(self._on_free))
        p.wrap(alloc, "mark_complete_blocks", self._lifecycle(self._on_mark_complete))
        p.wrap(alloc, "copy_blocks", self._lifecycle(self._on_copy, device=True))
        p.wrap(cache, "search_prefix_match", self._lifecycle(self._on_prefix_match))
        p.wrap(cache, "evict_cached_blocks", self._lifecycle(self._on_evict))
        p.wrap(cache, "reset", self._lifecycle(self._on_reset))

    # ------------------------------------------------------------------ the forward bracket

    def _wrap_prepare(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def prepare_batch_tensors(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            batch = _Batch.of(kwargs["requests_in_batch"] if "requests_in_batch" in kwargs else args[0])
            entered = self._enter()  # transformers' writes of the inputs go to the compute stream
            t1 = time.perf_counter()
            try:
                out = orig(*args, **kwargs)
            finally:
                t2 = time.perf_counter()
                self._leave(entered)
            # warmup batches (graphs/compile) run fake requests outside the generation step; a reset follows them
            self.pending = None if any(i.startswith("__warmup_") for i in batch.ids) else batch
            # the batch snapshot's and the stream switch's host time (canary time outside the bracket, like the
            # lifecycle wrappers')
            self.stats["snapshot_us"] += int(1e6 * (time.perf_counter() - t2 + t1 - t0))
            return out
        return prepare_batch_tensors

    def _wrap_step(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def _generation_step(model: Any) -> Any:
            scheduled, self.pending = self.pending, None
            if scheduled is None or not scheduled.ids or self.disabled:
                self.stats["unbracketed_steps"] += 1
                return orig(model)
            self.hf_failed = self.ran_hf = False
            try:
                return self._bracket(orig, model, scheduled)
            except Exception as e:
                if self.hf_failed:  # transformers' own step failed: its loop reports that
                    raise
                err = e if isinstance(e, KVCanaryError) else \
                    TransformersIntegrationError(f"kvcanary failed around a generation step: {e!r}")
                if err is not e:
                    err.__cause__ = e
                if self.handle.config.mode == CanaryMode.RAISE:
                    self.handle._stash(err)
                    raise err from e if err is not e else None
                # LOG mode never raises: keep generating without the canary on this cache
                self.disabled = True
                self.handle.failures.append(err)
                logger.error("kvcanary: disabled on this cache after an internal failure: %r", err, exc_info=e)
                return None if self.ran_hf else orig(model)
        return _generation_step

    def _bracket(self, orig: Callable[..., Any], model: Any, scheduled: _Batch) -> Any:
        t0 = time.perf_counter()
        io = self.proc.inputs_and_outputs
        if io.use_block_table:
            raise TransformersIntegrationError("the block-table (flash) decode path writes KV inside its kernel; "
                                               "kvcanary needs max_blocks_per_request=0")
        entered = self._enter()
        try:
            batch = self.adapter.batch_view(io, scheduled)
            check = self._arm_write_check(batch)
            with self.canary.forward(batch):
                self.canary.pre_forward()
                if check:
                    self.write_ptr = io.write_index_storage.data_ptr()  # its row 0's: no view made
                t1 = time.perf_counter()
                self.ran_hf = True
                try:
                    out = orig(model)
                except BaseException:
                    self.hf_failed = True
                    raise
                finally:
                    self.in_forward = False
                t2 = time.perf_counter()
                self.canary.post_forward()
        finally:
            self._leave(entered)
        self.stats["forwards"] += 1
        self.stats["tokens"] += batch.num_tokens
        # host time of the bracket around transformers' step (the kernels are asynchronous on CUDA)
        self.stats["bracket_us"] += int(1e6 * (time.perf_counter() - t2 + t1 - t0))
        if check:
            self._check_writes((batch.batch_size, batch.num_tokens))
        return out

    def _enter(self) -> tuple[StreamSwitch, Was] | None:
        """Make transformers' compute stream current (None: it has none, nothing done); what :meth:`_leave` takes.

        Every device op of this cache runs on that one stream, so host order orders them and a step queues no event
        (an event record costs 14-48 µs inside the step, bench/results/host_session28). Those ops: transformers'
        batch preparation (its writes of the inputs the canary stages), its forward and block copies
        (:meth:`_wrap_prepare`, :meth:`_bracket`, the copy wrapper), all the canary's work, and once per batch
        processor the work queued before on the stream current then (:meth:`join`)."""
        stream = self.proc.inputs_and_outputs.compute_stream
        if stream is None:
            return None
        switch = self._switch
        if switch is None or switch.stream is not stream:
            switch = self._switch = StreamSwitch(stream)
        return switch, switch.enter()

    @staticmethod
    def _leave(entered: tuple[StreamSwitch, Was] | None) -> None:
        """Make current again what was current before :meth:`_enter` (``entered``: what it returned)."""
        if entered is not None:
            entered[0].leave(entered[1])

    def join(self) -> None:
        """The compute stream's later work runs after what the current stream has queued so far: a new or reset batch
        processor's buffers (transformers fills them there) and the canary's own state."""
        stream = self.proc.inputs_and_outputs.compute_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(stream.device))

    def flush(self) -> None:
        """Collect the canary's last window from the calling thread (a stopped manager, uninstall): its current
        stream first waits for everything queued on the compute stream."""
        stream = self.proc.inputs_and_outputs.compute_stream
        if stream is not None:
            torch.cuda.current_stream(stream.device).wait_stream(stream)
        self.canary.flush()

    def _wrap_update(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def update(key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, read_index: torch.Tensor,
                   write_index: torch.Tensor) -> Any:
            if self.in_forward:
                self.layer_writes += 1
                if write_index.data_ptr() != self.write_ptr:
                    self.stray_writes += 1
            return orig(key_states, value_states, layer_idx, read_index, write_index)
        return update

    def _arm_write_check(self, batch: BatchView) -> bool:
        """Whether this forward checks its KV writes (:meth:`_check_writes`): the first forward of a batch shape (rows,
        tokens) and every ``WRITE_CHECK_INTERVAL``-th forward. The per-layer hook is installed for those forwards only:
        in every layer's call it costs microseconds of host time."""
        check = self.stats["forwards"] % WRITE_CHECK_INTERVAL == 0 or \
            (batch.batch_size, batch.num_tokens) not in self._write_shapes
        if check is not self._hooked:
            self.adapter.alloc.update = self._hook if check else self._unhooked
            self._hooked = check
        self.in_forward, self.layer_writes, self.stray_writes = check, 0, 0
        return check

    def _check_writes(self, shape: tuple[int, int]) -> None:
        """Every layer must have written KV exactly through the batch's write slots. With CUDA graphs a replay runs
        no Python (0 calls) and a capture runs the forward twice (eager warm-up, then capture). A batch ``shape`` that
        passed is checked again only every ``WRITE_CHECK_INTERVAL`` forwards."""
        layers, seen = self.adapter.num_layers, self.layer_writes
        self.stats["write_checks"] += 1
        if self.stray_writes == 0 and (seen == layers or (self.graphs and seen in (0, 2 * layers))):
            if len(self._write_shapes) >= MAX_WRITE_SHAPES:  # an engine of ever new shapes: forget the old ones
                self._write_shapes.clear()
            self._write_shapes.add(shape)
            return
        msg = (f"kvcanary: {self.layer_writes} KV writes ({self.stray_writes} through other slots than the batch's) "
               f"for {self.adapter.num_layers} layers: the KV was written outside the canary's view")
        self.stats["write_problems"] += 1
        if self.handle.config.mode == CanaryMode.RAISE:
            raise TransformersIntegrationError(msg)
        if self.stats["write_problems"] == 1:
            logger.warning(msg)

    # ------------------------------------------------------------------ block lifecycle

    def _lifecycle(self, on: Callable[..., Any], device: bool = False
                   ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """A wrapper maker: transformers' own call, then ``on(out, *args, **kwargs)`` (the canary's bookkeeping, whose
        result is returned). The wrapper's host time but transformers' call is added to ``stats["lifecycle_us"]``
        (canary time outside the bracket: these calls run in transformers' scheduler and update). ``device``: both
        queue device work, so both run with the compute stream current (:meth:`_enter`; its switch is counted too)."""
        def make(orig: Callable[..., Any]) -> Callable[..., Any]:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                entered = self._enter() if device else None
                try:
                    t1 = time.perf_counter()
                    try:
                        out = orig(*args, **kwargs)
                    finally:
                        t2 = time.perf_counter()
                    return on(out, *args, **kwargs)
                finally:
                    self._leave(entered)
                    self.stats["lifecycle_us"] += int(1e6 * (time.perf_counter() - t2 + t1 - t0))
            return wrapped
        return make

    def _on_free(self, out: Any, request_id: str, no_cache: bool = False) -> Any:
        self.adapter.touch()
        if no_cache:  # its hashed blocks went back to the pool and lost their hashes
            self.adapter.forget_hashes()
        if self.adapter.release(request_id):
            self.canary.release(request_id)
            self.stats["requests_released"] += 1
        return out

    def _on_mark_complete(self, out: Any, request_id: str, token_ids: list[int], new_new_blocks: int) -> Any:
        self.adapter.touch()
        self.adapter.on_blocks_hashed(request_id)
        return out

    def _on_copy(self, out: Any, source_block_ids: list[int], dest_block_ids: list[int]) -> Any:
        self.adapter.touch()
        self.adapter.copy_records(self.canary, source_block_ids, dest_block_ids)
        self.stats["blocks_copied"] += len(source_block_ids)
        return out

    def _on_prefix_match(self, out: Any, request_id: str, prompt_ids: list[int]) -> int:
        hit = int(out)
        self.adapter.touch()
        self.stats["prefix_lookups"] += 1
        self.stats["prefix_hits"] += int(hit > 0)
        self.stats["prefix_hit_tokens"] += hit
        return hit

    def _on_evict(self, out: Any) -> bool:
        # transformers calls this every step while the cache is under its safety margin; a call that evicted nothing
        # changed nothing (every ledger change of an eviction is reported by its True)
        if out:
            self.adapter.touch()
            self.adapter.forget_hashes()
            self.stats["evictions"] += 1
        return bool(out)

    def _on_reset(self, out: Any) -> Any:
        self.adapter.touch()
        self.adapter.forget_hashes()
        return out

    def close(self) -> None:
        """Flush the canary's last window (stashing a RAISE error) and remove this session's wrappers."""
        try:
            self.flush()
        except KVCanaryError as e:
            self.handle._stash(e)
        finally:
            self.patches.restore()


class TransformersCanary:
    """The handle returned by :func:`install`: reports, violations, errors, stats; ``uninstall()`` restores all."""

    def __init__(self, config: CanaryConfig, sinks: Sequence[ReportSink] = (), req_rows: int | None = None,
                 max_context: int | None = None) -> None:
        self.config = config
        self.sinks = list(sinks)
        self.req_rows = req_rows
        self.max_context = max_context
        self.reports: list[WindowReport] = []
        self.errors: list[KVCanaryError] = []  # raised to the caller (RAISE mode)
        self.failures: list[KVCanaryError] = []  # LOG mode: internal failures that disabled a session's canary
        self._raised: set[int] = set()
        self._lock = threading.Lock()
        self._patches = _Patches()
        self._hf_managers: dict[int, Any] = {}
        self._sessions: dict[int, _Session] = {}
        self._closed_stats: Counter[str] = Counter()
        self.last_canary: CanaryManager | None = None
        self._tls = threading.local()
        self.installed = False

    # ------------------------------------------------------------------ results

    @property
    def violations(self) -> list[Violation]:
        """Every kept violation row so far (all sessions)."""
        with self._lock:
            return [v for r in self.reports for v in r.violations]

    @property
    def total_violations(self) -> int:
        """Exact number of violations so far (kept or not)."""
        with self._lock:
            return sum(r.total for r in self.reports)

    @property
    def stats(self) -> Counter[str]:
        """Adapter counters (forwards, prefix hits, blocks copied, requests released, ...)."""
        out = Counter(self._closed_stats)
        for s in list(self._sessions.values()):
            for _ in range(8):  # the generation thread may add a key while we copy
                try:
                    out.update(dict(s.stats))
                    break
                except RuntimeError:
                    continue
        return out

    @property
    def host_us(self) -> int:
        """kvcanary's host time so far on transformers' generation thread, µs: the forward bracket, the batch snapshot
        and the block lifecycle wrappers (``stats`` keys :data:`HOST_TIME_KEYS`). The KV-write hook inside the forward
        (a counter and a pointer compare per layer) is not timed."""
        st = self.stats
        return sum(st[k] for k in HOST_TIME_KEYS)

    @property
    def canaries(self) -> list[CanaryManager]:
        """The kvcanary managers of the live sessions (one per transformers cache)."""
        return [s.canary for s in self._sessions.values()]

    def check(self) -> None:
        """Raise the first canary error of this handle (CanaryViolationError in RAISE mode), if any."""
        with self._lock:
            err = self.errors[0] if self.errors else None
        if err is not None:
            raise err

    # ------------------------------------------------------------------ install / uninstall

    def attach_model(self, model: Any) -> None:
        """Guard every continuous-batching run of ``model`` (generate_batch, init_continuous_batching)."""
        if not callable(getattr(model, "init_continuous_batching", None)):
            raise TransformersIntegrationError(f"{type(model).__name__} has no continuous batching")

        def wrap_init(orig: Callable[..., Any]) -> Callable[..., Any]:
            def init_continuous_batching(*args: Any, **kwargs: Any) -> Any:
                mgr = orig(*args, **kwargs)
                self.attach_manager(mgr)
                return mgr
            return init_continuous_batching

        def wrap_generate(orig: Callable[..., Any]) -> Callable[..., Any]:
            def generate_batch(*args: Any, **kwargs: Any) -> Any:
                self._tls.depth = getattr(self._tls, "depth", 0) + 1
                try:
                    out = orig(*args, **kwargs)
                finally:
                    self._tls.depth -= 1
                self._raise_pending()
                return out
            return generate_batch

        self._patches.wrap(model, "init_continuous_batching", wrap_init)
        self._patches.wrap(model, "generate_batch", wrap_generate)
        cached = getattr(model, "_cached_continuous_batching_manager", None)
        if cached is not None:
            self.attach_manager(cached)

    def attach_manager(self, mgr: Any) -> None:
        """Guard one ContinuousBatchingManager (before it starts)."""
        if id(mgr) in self._hf_managers:
            return
        _validate_manager(mgr)
        self._hf_managers[id(mgr)] = mgr

        def wrap_create(orig: Callable[..., Any]) -> Callable[..., Any]:
            def _create_batch_processor() -> Any:
                proc = orig()
                try:
                    self._attach_processor(mgr, proc)
                except KVCanaryError as e:
                    self._stash(e)
                    raise
                return proc
            return _create_batch_processor

        def wrap_get_result(orig: Callable[..., Any]) -> Callable[..., Any]:
            def get_result(*args: Any, **kwargs: Any) -> Any:
                inside = getattr(self._tls, "depth", 0) > 0  # generate_batch swallows it: its wrapper raises
                if not inside:
                    self._raise_pending()
                out = orig(*args, **kwargs)
                if not inside:
                    self._raise_pending()
                return out
            return get_result

        def wrap_stop(orig: Callable[..., Any]) -> Callable[..., Any]:
            def stop(*args: Any, **kwargs: Any) -> Any:
                out = orig(*args, **kwargs)
                if not mgr.is_running():
                    self._after_stop(mgr)
                    if getattr(self._tls, "depth", 0) == 0:
                        self._raise_pending()
                return out
            return stop

        self._patches.wrap(mgr, "_create_batch_processor", wrap_create)
        self._patches.wrap(mgr, "get_result", wrap_get_result)
        self._patches.wrap(mgr, "stop", wrap_stop)
        if mgr.batch_processor is not None:
            self._attach_processor(mgr, mgr.batch_processor)

    def _attach_processor(self, mgr: Any, proc: Any) -> None:
        """A session for a new batch processor; a created or reset one's buffers ordered before its compute stream's
        work (:meth:`_Session.join`)."""
        session = self._sessions.get(id(proc))
        if session is None:
            session = self._new_session(mgr, proc)
        session.join()

    def _new_session(self, mgr: Any, proc: Any) -> _Session:
        cache = proc.cache
        live = [rid for a in cache.cache_allocators.values() for rid in a.block_table]
        if live:
            raise TransformersIntegrationError(f"requests {live[:4]} hold KV written before kvcanary was installed; "
                                               "install before the manager starts")
        if any(a.ledger.cached_blocks for a in cache.cache_allocators.values()):
            logger.warning("kvcanary: evicting prefix-cache blocks written before kvcanary was installed")
            cache.evict_cached_blocks()
        session = _Session(self, mgr, proc)
        self._sessions[id(proc)] = session
        self.last_canary = session.canary
        return session

    def _after_stop(self, mgr: Any) -> None:
        """Flush the sessions of a stopped manager; close those whose processor it dropped."""
        for key, s in list(self._sessions.items()):
            if s.hf_manager is not mgr:
                continue
            if mgr.batch_processor is s.proc:  # kept for the next session: flush only
                try:
                    s.flush()
                except KVCanaryError as e:
                    self._stash(e)
                continue
            s.close()
            self._closed_stats.update(s.stats)
            del self._sessions[key]

    def uninstall(self) -> None:
        """Remove every wrapper (stopped managers only); the objects are exactly as before install."""
        running = [m for m in self._hf_managers.values() if m.is_running()]
        if running:
            raise TransformersIntegrationError("stop the continuous batching manager before uninstalling kvcanary")
        for key, s in list(self._sessions.items()):
            s.close()
            self._closed_stats.update(s.stats)
            del self._sessions[key]
        self._patches.restore()
        self._hf_managers.clear()
        self.installed = False

    def __enter__(self) -> TransformersCanary:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.uninstall()

    # ------------------------------------------------------------------ errors across the background thread

    def _on_report(self, report: WindowReport) -> None:
        with self._lock:
            self.reports.append(report)

    def _stash(self, err: KVCanaryError) -> None:
        with self._lock:
            if all(e is not err for e in self.errors):
                self.errors.append(err)

    def _raise_pending(self) -> None:
        """Re-raise, once, a canary error that the generation thread swallowed."""
        with self._lock:
            err = next((e for e in self.errors if id(e) not in self._raised), None)
            if err is not None:
                self._raised.add(id(err))
        if err is not None:
            raise err

    def iter_sessions(self) -> Iterator[_Session]:
        """Live sessions (for diagnostics and tests)."""
        return iter(list(self._sessions.values()))


def _validate_manager(mgr: Any) -> None:
    """Refuse configurations whose KV writes or token ids the canary cannot see."""
    cfg = mgr.continuous_batching_config
    attn = mgr.model.config._attn_implementation
    problems = []
    if cfg.use_async_batching:
        problems.append("use_async_batching=True (host input ids are placeholders): set use_async_batching=False")
    if attn not in _SUPPORTED_ATTN:
        problems.append(f"attention {attn!r} writes KV inside its kernel: use attn_implementation='sdpa' and "
                        "ContinuousBatchingConfig(auto_switch_to_flash=False)")
    if cfg.max_blocks_per_request:
        problems.append(f"max_blocks_per_request={cfg.max_blocks_per_request} (block-table decode path): set 0")
    if cfg.cpu_offload_space:
        problems.append("cpu_offload_space > 0 (blocks swapped to CPU move without their canary records): set 0")
    from transformers.generation.continuous_batching.cache import group_layers_by_attn_type

    groups = list(group_layers_by_attn_type(mgr.model.config.get_text_config()))
    if groups != [_FULL]:
        problems.append(f"layer groups {groups}: only full-attention-only models are supported")
    if problems:
        raise TransformersIntegrationError("kvcanary cannot guard this continuous batching setup: "
                                           + "; ".join(problems))
    if mgr.is_running():
        raise TransformersIntegrationError("install kvcanary before the continuous batching manager starts")


def install(model_or_manager: Any, config: CanaryConfig | None = None, *, sinks: Sequence[ReportSink] = (),
            req_rows: int | None = None, max_context: int | None = None) -> TransformersCanary:
    """Install kvcanary into a transformers model's continuous batching (``generate_batch``,
    ``init_continuous_batching``) or into one ``ContinuousBatchingManager`` (before ``start()``).

    One kvcanary manager is installed per transformers paged cache when its batch processor is created.
    RAISE mode: ``generate_batch`` / ``get_result`` / ``stop`` raise the CanaryViolationError that the generation
    thread hit. ``req_rows`` (live requests) and ``max_context`` (tokens per request) size the slot table; the
    defaults derive from the cache. Returns a handle; ``handle.uninstall()`` (or ``with install(...)``) restores
    every wrapped object exactly. ``config`` defaults to ``CanaryConfig.from_env()``.
    """
    api = _check_transformers()
    cfg = config if config is not None else CanaryConfig.from_env()
    handle = TransformersCanary(cfg, sinks, req_rows, max_context)
    if cfg.mode == CanaryMode.NONE:
        return handle
    try:
        if isinstance(model_or_manager, api.ContinuousBatchingManager):
            handle.attach_manager(model_or_manager)
        else:
            handle.attach_model(model_or_manager)
    except BaseException:
        handle.uninstall()  # all or nothing
        raise
    handle.installed = True
    return handle
