"""kvcanary inside vLLM 0.32: a KV connector (kv_transfer_config) that guards vLLM's paged KV cache.

Turn it on with one config line (composable with other connectors through ``MultiConnector``)::

    LLM(..., kv_transfer_config=KVTransferConfig(kv_connector="KVCanaryConnector",
        kv_connector_module_path="kvcanary.integrations.vllm", kv_role="kv_both",
        kv_connector_extra_config={"mode": "log", "fingerprint": "all"}))

vLLM loads the class twice. The SCHEDULER instance computes, per step and scheduled request, the canary's batch
facts and its token truth (expected chain values of the request's true tokens, O(new tokens)), remembers where every
block sits in its request for the prefix-cache export, and quarantines corrupted cached blocks through the block
pool. The WORKER instance runs HEAD in ``start_load_kv`` (before the forward) and TAIL in ``wait_for_save`` (after
it), addressing vLLM's block tables natively (``table_page`` = block size) and fingerprinting the real per-layer
paged KV tensors. See docs/vllm.md.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from kvcanary_schema import FingerprintMode, Group
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvcanary.adapter import BatchView, GroupSpec, PoolDescription, PrefixCacheExport
from kvcanary.config import CanaryConfig, CanaryMode
from kvcanary.errors import CanaryInputError, KVCanaryError
from kvcanary.hostcopy import export_of_blocks
from kvcanary.manager import CanaryManager, install
from kvcanary.ops.types import SourceSpec
from kvcanary.report import WindowReport
from kvcanary.truth import KeyedChains, host_hashers

logger = logging.getLogger("kvcanary")

SUPPORTED_VERSION = "0.32.0"
# kv_connector_extra_config keys besides CanaryConfig's fields
CONNECTOR_OPTIONS = ("quarantine",)
_NOT_CONFIGURABLE = ("perturb",)  # perturbation edits per-token slot tables; vLLM's are block tables
_STATS_KEYS = ("forwards", "violations", "sweeps", "quarantined_blocks", "host_us")


class VLLMIntegrationError(KVCanaryError, RuntimeError):
    """vLLM is of another version, or configured in a way kvcanary cannot guard (raised at engine start)."""


# ---------------------------------------------------------------------------------------------------- configuration

@dataclass(frozen=True)
class ConnectorConfig:
    """The canary's CanaryConfig plus the connector's own options."""

    canary: CanaryConfig
    quarantine: bool = True  # evict corrupted cached blocks from vLLM's prefix cache (later hits recompute them)


def connector_config(extra: Mapping[str, Any] | None) -> ConnectorConfig:
    """``kv_connector_extra_config`` over the ``KVCANARY_*`` environment (the extra config wins); unknown keys and
    bad values raise VLLMIntegrationError naming them."""
    extra = dict(extra or {})
    knobs = {f.name for f in dataclasses.fields(CanaryConfig)} - set(_NOT_CONFIGURABLE)
    unknown = sorted(set(extra) - knobs - set(CONNECTOR_OPTIONS))
    if unknown:
        raise VLLMIntegrationError(f"kvcanary: unknown kv_connector_extra_config option(s) {unknown}; allowed: "
                                   f"{sorted(knobs | set(CONNECTOR_OPTIONS))}")
    quarantine = extra.pop("quarantine", True)
    if not isinstance(quarantine, bool):
        raise VLLMIntegrationError(f"kvcanary: quarantine must be true or false, got {quarantine!r}")
    try:
        canary = CanaryConfig.from_env(**extra)
    except (CanaryInputError, TypeError) as e:
        raise VLLMIntegrationError(f"kvcanary: bad kv_connector_extra_config: {e}") from e
    if canary.perturb.enabled:
        raise VLLMIntegrationError("kvcanary: KVCANARY_PERTURB_* needs a per-token slot table; vLLM's are block tables")
    return ConnectorConfig(canary, quarantine)


def _check_version() -> None:
    import vllm

    if vllm.__version__ != SUPPORTED_VERSION:
        raise VLLMIntegrationError(f"kvcanary.integrations.vllm supports vLLM {SUPPORTED_VERSION}, found "
                                   f"{vllm.__version__}")


# ---------------------------------------------------------------------------------------------------- KV layout

# A layout: the element offsets (inside one block) of every token's K or V, per half, found by running the backend's
# own KV write op on a scratch block. A half is readable when each token's elements form, per head, one contiguous
# run at a fixed stride from the previous token's (a row of ``run`` elements); None when not (e.g. a transposed K).
HalfRuns = list[int] | None  # per head: the element offset of token 0's run (run length = head_size)
ProbeFn = Callable[[torch.Tensor, int, int, int, Any], tuple[HalfRuns, HalfRuns]]


def runs_of(offsets: list[list[int]], heads: int, head: int) -> HalfRuns:
    """Per head, token 0's run start, if token t's elements are ``heads`` runs of ``head`` elements each at
    ``start_h + t * head``; None otherwise. ``offsets[t]`` lists token t's element offsets in the block."""
    starts: list[int] = []
    for t, offs in enumerate(offsets):
        runs = sorted(offs)
        if len(runs) != heads * head:
            return None
        heads_starts = runs[::head]
        for k, st in enumerate(heads_starts):
            if runs[k * head:(k + 1) * head] != list(range(st, st + head)):
                return None
        if t == 0:
            starts = heads_starts
        elif heads_starts != [st + t * head for st in starts]:
            return None
    return starts


def _cpu_attn_probe(t: torch.Tensor, block: int, heads: int, head: int, isa: Any) -> tuple[HalfRuns, HalfRuns]:
    """CPU_ATTN: write each token of a scratch block with vLLM's own ``cpu_attn_reshape_and_cache`` and see where its
    K and V land (the kernel's layout depends on the ISA: with ``vec`` K is stored transposed)."""
    from vllm import _custom_ops as ops

    if t.dim() != 4 or tuple(t.shape[1:]) != (heads, block, 2 * head):
        raise VLLMIntegrationError(f"CPU_ATTN KV tensor {tuple(t.shape)}: expected [blocks, {heads}, {block}, "
                                   f"{2 * head}]")
    scratch = torch.zeros((1, heads, block, 2 * head), dtype=t.dtype)
    kc, vc = scratch.view(1, heads, 2 * block, head).chunk(2, dim=2)
    ones = torch.ones(1, heads, head, dtype=t.dtype)
    zeros = torch.zeros_like(ones)
    found: list[list[list[int]]] = [[], []]
    for tok in range(block):
        for half in (0, 1):
            scratch.zero_()
            ops.cpu_attn_reshape_and_cache(ones if half == 0 else zeros, zeros if half == 0 else ones, kc, vc,
                                           torch.tensor([tok], dtype=torch.int64), isa)
            found[half].append(scratch.view(-1).nonzero().squeeze(1).tolist())
    return runs_of(found[0], heads, head), runs_of(found[1], heads, head)


# attention backend name -> how to find its layout
LAYOUT_PROBES: dict[str, ProbeFn] = {"CPU_ATTN": _cpu_attn_probe}


def layer_sources(runs: tuple[HalfRuns, HalfRuns], tensor: torch.Tensor, block: int,
                  head: int) -> list[list[SourceSpec]]:
    """Fingerprint sources of one layer for each readable half (one per head: rows = blocks of ``block`` tokens of
    ``head`` contiguous elements); an unreadable half gets none."""
    if not tensor.is_contiguous():
        raise VLLMIntegrationError(f"KV tensor strides {tensor.stride()} are not the probed contiguous layout")
    bpt, stride = head * tensor.element_size(), tensor[0].numel()
    return [[] if r is None else
             [SourceSpec(torch.as_strided(tensor, (tensor.shape[0], block, head), (stride, head, 1),
                                          tensor.storage_offset() + st), block, bpt) for st in r] for r in runs]


def probe_layout(backend: str, tensor: torch.Tensor, block: int, heads: int, head: int,
                 isa: Any) -> tuple[HalfRuns, HalfRuns]:
    """The readable halves of a backend's KV layout, found by running its write op; VLLMIntegrationError for a
    backend kvcanary cannot probe."""
    fn = LAYOUT_PROBES.get(backend)
    if fn is None:
        raise VLLMIntegrationError(f"kvcanary cannot read the KV layout of attention backend {backend!r} (known: "
                                   f"{sorted(LAYOUT_PROBES)}); use fingerprint=none")
    return fn(tensor, block, heads, head, isa)


# ---------------------------------------------------------------------------------------------------- metadata

@dataclass
class ReqFacts:
    """One scheduled request of a step, as the scheduler planned it."""

    prefix_len: int  # tokens already computed (prefix-cache hits included)
    extend_len: int  # tokens scheduled now
    expect_prefix: int | None  # true chain value after the prefix (int64), None when unknown
    expect_new: int | None  # ... after the new tokens
    # 0, or k > 0 when its prefix holds a block that a level k-1 request of this step writes (a prefix-cache hit on
    # blocks computed in the same forward): its bracket runs after the forward, once those records exist
    level: int = 0


@dataclass
class CacheExport:
    """Cached blocks of vLLM's prefix cache whose parents are cached too: block id, first position, parent block."""

    blocks: np.ndarray
    first_positions: np.ndarray
    parents: np.ndarray  # -1 = first block of its sequence


class KVCanaryMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler -> worker, one step."""

    def __init__(self, step: int, reqs: dict[str, ReqFacts], export: CacheExport | None) -> None:
        """Facts of the step's scheduled requests and, on sweep steps, the prefix-cache export."""
        self.step, self.reqs, self.export = step, reqs, export


class KVCanaryWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Worker -> scheduler: blocks found corrupted (to quarantine)."""

    def __init__(self, blocks: set[int]) -> None:
        """The corrupted blocks."""
        self.blocks = set(blocks)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Union over workers."""
        return KVCanaryWorkerMetadata(self.blocks | getattr(other, "blocks", set()))


class KVCanaryStats(KVConnectorStats):  # type: ignore[misc]
    """Counters since the last collection (summed over workers and intervals)."""

    def reset(self) -> None:
        """Zero every counter."""
        self.data = dict.fromkeys(_STATS_KEYS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Add ``other``'s counters."""
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        """The counters as they are."""
        return {k: int(v) for k, v in self.data.items()}

    def is_empty(self) -> bool:
        """True when nothing was counted."""
        return not any(self.data.values())


class KVCanaryPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """Counters in vLLM's own Prometheus registry (``vllm:kvcanary_*``)."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        """Register one counter per stats key."""
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from vllm.v1.metrics.utils import create_metric_per_engine

        docs = {"forwards": "forwards bracketed by kvcanary", "violations": "kvcanary violations (exact count)",
                "sweeps": "prefix-cache sweeps run", "quarantined_blocks": "cached blocks evicted as corrupted",
                "host_us": "kvcanary host microseconds"}
        self.counters = {k: create_metric_per_engine(
            self._counter_cls(name=f"vllm:kvcanary_{k}", documentation=docs[k], labelnames=labelnames),
            per_engine_labelvalues) for k in _STATS_KEYS}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one interval's counters."""
        for k, v in transfer_stats_data.items():
            if k in self.counters and v:
                self.counters[k][engine_idx].inc(v)


# ---------------------------------------------------------------------------------------------------- scheduler side

class _SchedulerSide:
    """Token truth, block positions for the prefix-cache export, quarantine."""

    def __init__(self, cfg: ConnectorConfig, block_size: int, num_blocks: int) -> None:
        self.cfg, self.bs = cfg, block_size
        self.reqs: dict[str, Any] = {}
        self.chains = KeyedChains(0, *host_hashers(cfg.canary.resolved_backend("cpu")))
        # per running request, the last block _place_blocks placed: (its index in the request's table, its id)
        self.placed: dict[str, tuple[int, int]] = {}
        self.first_pos = np.full(num_blocks, -1, dtype=np.int64)
        self.parent = np.full(num_blocks, -1, dtype=np.int64)
        # content generation of a block (bumped whenever it is written from its first token) and, per block, its
        # parent's generation when it was written: a parent reused since then no longer precedes it
        self.gen = np.zeros(num_blocks, dtype=np.int64)
        self.parent_gen = np.zeros(num_blocks, dtype=np.int64)
        self.pool: Any = None
        self.manager: Any = None
        self.step = 0
        self.quarantined = 0
        # what the workload exercised: preempted requests, prefix-cache hits, chunked prefills, mixed steps
        self.counts: Counter[str] = Counter()

    def facts(self, so: Any) -> KVCanaryMetadata:
        self.step += 1
        preempted = list(so.preempted_req_ids or ())
        for rid in list(so.finished_req_ids) + preempted:
            self.forget(rid)
        self.counts["preempted"] += len(preempted)
        reqs: dict[str, ReqFacts] = {}
        kinds: set[str] = set()
        rids = list(so.num_scheduled_tokens)
        states = [self.reqs[rid] for rid in rids]
        pre = np.fromiter((int(r.num_computed_tokens) for r in states), dtype=np.int64, count=len(rids))
        ext = np.fromiter((int(so.num_scheduled_tokens[rid]) for rid in rids), dtype=np.int64, count=len(rids))
        # the step's token truth in bulk (chain_truth per request is its oracle)
        t = self.chains.forward(rids, pre, ext, [r.all_token_ids for r in states])
        ep, en = t.expect_prefix.tolist(), t.expect_new.tolist()
        pk, nk = t.prefix_known.tolist(), t.new_known.tolist()
        written: dict[str, list[int]] = {}
        for i, (rid, req, p, e) in enumerate(zip(rids, states, pre.tolist(), ext.tolist(), strict=True)):
            reqs[rid] = ReqFacts(p, e, ep[i] if pk[i] else None, en[i] if nk[i] else None)
            written[rid] = self._place_blocks(rid, p, e)
            prompt = int(req.num_prompt_tokens)
            kinds.add("prefill" if p < prompt else "decode")
            self.counts["chunked"] += int(p + e < prompt)
        for rid in so.scheduled_new_reqs:
            self.counts["prefix_hits"] += int(rid.num_computed_tokens > 0)
        self.counts["mixed_steps"] += int(len(kinds) == 2)
        self._levels(reqs, written)
        iv = self.cfg.canary.sweep_interval
        export = self.export() if iv and self.step % iv == 0 and self.pool is not None else None
        return KVCanaryMetadata(self.step, reqs, export)

    def _levels(self, reqs: dict[str, ReqFacts], written: dict[str, list[int]]) -> None:
        """Requests whose prefix holds blocks other requests write in this step (shared blocks: ref_cnt > 1;
        ``written``: the blocks each request writes). Costs O(new blocks) per request; the prefixes are scanned only in
        steps that write a shared block."""
        if self.manager is None or self.pool is None:
            return
        writer: dict[int, str] = {}
        for rid, blocks in written.items():
            for b in blocks:
                if self.pool.blocks[b].ref_cnt > 1:
                    writer[b] = rid
        if not writer:
            return
        reads = {rid: [writer[b] for b in self.manager.get_block_ids(rid)[0][:f.prefix_len // self.bs]
                       if writer.get(b, rid) != rid] for rid, f in reqs.items()}
        for _ in range(len(reqs)):
            changed = False
            for rid, ws in reads.items():
                lvl = max((reqs[w].level + 1 for w in ws), default=0)
                if lvl > reqs[rid].level:
                    reqs[rid].level, changed = lvl, True
            if not changed:
                break
        self.counts["same_step_hits"] += sum(1 for f in reqs.values() if f.level)

    def forget(self, rid: str) -> None:
        """A request that finished or was preempted: its token truth and block placement start over."""
        self.chains.drop(rid)
        self.placed.pop(rid, None)

    def _place_blocks(self, rid: str, pre: int, ext: int) -> list[int]:
        """Record first position and parent of the blocks this step writes (O(new blocks)); returns those blocks. A step
        that writes only into the middle of the block this request placed last (most decode steps) changes nothing and
        asks vLLM for nothing."""
        if self.manager is None:
            return []
        first, last = pre // self.bs, (pre + ext - 1) // self.bs
        done = self.placed.get(rid)
        if done is not None and first == last == done[0] and pre % self.bs:
            return [done[1]]
        blocks = self.manager.get_block_ids(rid)[0]
        end = min(last + 1, len(blocks))
        if end > first:
            self.placed[rid] = (end - 1, blocks[end - 1])
        for k in range(first, end):
            b = blocks[k]
            if k * self.bs >= pre:  # written from its first token: new content
                self.gen[b] += 1
            self.first_pos[b] = k * self.bs
            self.parent[b] = blocks[k - 1] if k > 0 else -1
            self.parent_gen[b] = self.gen[blocks[k - 1]] if k > 0 else 0
        return list(blocks[first:end])

    def export(self) -> CacheExport:
        """Vectorized export of the cached blocks (those the pool holds a hash for) that chain to cached parents."""
        placed = np.flatnonzero(self.first_pos >= 0)
        blocks = self.pool.blocks
        cached = placed[np.fromiter((blocks[b].block_hash is not None for b in placed), dtype=bool,
                                    count=placed.shape[0])]
        par = self.parent[cached]
        mask = np.zeros(self.first_pos.shape[0], dtype=bool)
        mask[cached] = True
        p = np.maximum(par, 0)
        ok = (par < 0) | (mask[p] & (self.first_pos[p] + self.bs == self.first_pos[cached])
                          & (self.gen[p] == self.parent_gen[cached]))
        return CacheExport(cached[ok], self.first_pos[cached[ok]], par[ok])

    def quarantine(self, blocks: set[int]) -> None:
        """Evict corrupted blocks from the prefix cache: later requests with that prefix recompute it."""
        if not blocks or self.pool is None or not self.cfg.quarantine:
            return
        self.pool.evict_blocks(blocks)
        self.quarantined += len(blocks)
        self.first_pos[list(blocks)] = -1
        logger.warning("kvcanary: quarantined %d corrupted block(s) %s: evicted from the prefix cache",
                       len(blocks), sorted(blocks)[:8])


# ---------------------------------------------------------------------------------------------------- worker side

def _find_model_runner() -> Any:
    """vLLM 0.32's V1 model runner, found once among the callers of register_kv_caches (its ``start_load_kv`` gets
    no request ids; the runner's input batch holds them in row order). Read only, never patched."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    frame = sys._getframe(1)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if isinstance(obj, GPUModelRunner):
            return obj
        frame = frame.f_back  # type: ignore[assignment]
    raise VLLMIntegrationError("kvcanary: register_kv_caches was not called by vLLM's model runner")


class _WorkerSide:
    """The canary manager over vLLM's paged KV and the per-step bracket."""

    def __init__(self, cfg: ConnectorConfig, vllm_config: Any, kv_cache_config: Any) -> None:
        self.cfg, self.vllm_config, self.kv_cache_config = cfg, vllm_config, kv_cache_config
        groups = kv_cache_config.kv_cache_groups
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        if len(groups) != 1 or type(groups[0].kv_cache_spec) is not FullAttentionSpec:
            raise VLLMIntegrationError(f"kvcanary guards models with one full-attention KV cache group; this one has "
                                       f"{[type(g.kv_cache_spec).__name__ for g in groups]}")
        self.spec = groups[0].kv_cache_spec
        self.layers = list(groups[0].layer_names)
        self.canary: CanaryManager | None = None
        self.runner: Any = None
        self.open = False
        self.bad_blocks: set[int] = set()
        self.stats = dict.fromkeys(_STATS_KEYS, 0)  # since vLLM last collected them
        self.host_us_total = 0  # the canary's own host time, all steps (benchmarks)
        self.reports: list[WindowReport] = []
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.deferred: list[BatchView] = []  # higher-level rows of the open step (bracketed after the forward)
        self.fingerprinted = ""  # the halves whose bytes the fingerprints cover ("KV", "V", or "" = none)

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Describe the pool from the real per-layer tensors and install the canary."""
        self.runner = _find_model_runner()
        self.kv_caches = kv_caches
        spec, cfg = self.spec, self.cfg.canary
        first = kv_caches[self.layers[0]]
        num_blocks, bs = int(first.shape[0]), int(spec.block_size)
        halves, sources = 2, None
        if cfg.fingerprint != FingerprintMode.NONE:
            sources = self._sources(kv_caches, bs)
            halves = len(sources)
        # block 0 is vLLM's null block (padding): reserved, never verified
        group = GroupSpec(Group.FULL, num_blocks * bs, halves, bs, sources=sources)
        sched = self.vllm_config.scheduler_config
        max_len = int(self.vllm_config.model_config.max_model_len)
        pool = PoolDescription(num_blocks * bs, int(sched.max_num_seqs), max_len, [group], first.device, bs,
                               table_page=bs)
        run_cfg = cfg.replace(mode=CanaryMode.LOG, req_capacity=max(cfg.req_capacity, int(sched.max_num_seqs)),
                              token_capacity=max(cfg.token_capacity, int(sched.max_num_batched_tokens)))
        self.canary = install(pool, run_cfg, sinks=[self._on_report])
        self.block_size = bs

    def _sources(self, kv_caches: dict[str, torch.Tensor], bs: int) -> list[list[SourceSpec]]:
        """Per readable half, one source per layer and head. A half the backend stores unreadably (CPU_ATTN's
        transposed K) is left out: the group then keeps one record per slot, fingerprinting the other half."""
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        layers = get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase, self.layers)
        heads, head = int(self.spec.num_kv_heads), int(self.spec.head_size)
        first = kv_caches[self.layers[0]]
        backend = layers[self.layers[0]].get_attn_backend().get_name()
        isa = self._isa(first.dtype, bs, head)
        runs = probe_layout(backend, first, bs, heads, head, isa)
        readable = [h for h, r in enumerate(runs) if r is not None]
        if not readable:
            # CPU_ATTN's amx kernels (bf16 on an AMX CPU; its block sizes are multiples of 32) pack K and V by pairs
            # of tokens; its float32 kernels keep V token-major
            hint = ", or dtype float32" if isa == "amx" else ""
            raise VLLMIntegrationError(f"fingerprint={self.cfg.canary.fingerprint.name.lower()}: attention backend "
                                       f"{backend} (isa {isa!r}) stores neither K nor V with a token's bytes "
                                       f"contiguous; kvcanary cannot fingerprint this layout: use fingerprint=none"
                                       f"{hint}")
        if len(readable) == 1:
            logger.warning("kvcanary: %s stores %s so that a token's bytes are not contiguous: fingerprints cover %s "
                           "only", backend, "KV"[1 - readable[0]], "KV"[readable[0]])
        halves: list[list[SourceSpec]] = [[] for _ in readable]
        for name in self.layers:
            per = layer_sources(runs, kv_caches[name], bs, head)
            for k, h in enumerate(readable):
                halves[k] += per[h]
        self.fingerprinted = "".join("KV"[h] for h in readable)
        return halves

    def _isa(self, dtype: torch.dtype, bs: int, head: int) -> Any:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return _get_attn_isa(dtype, bs, head, self.vllm_config.cache_config.cache_dtype)

    def begin(self, meta: KVCanaryMetadata, forward_context: Any) -> None:
        """HEAD of the level-0 rows before the forward: the batch as vLLM runs it (its block table, slot mapping, fed
        tokens and positions). Rows of a higher level are bracketed after the forward (:meth:`end`)."""
        self.deferred = []
        if self.canary is None or not meta.reqs:
            return
        md = forward_context.attn_metadata
        attn = md.get(self.layers[0]) if isinstance(md, dict) else None
        if attn is None:
            return  # profiling / dummy run
        t0 = time.perf_counter()
        n = int(attn.seq_lens.shape[0])
        rids = list(self.runner.input_batch.req_ids[:n])
        facts = [meta.reqs[r] for r in rids]
        levels = sorted({f.level for f in facts})
        views = [self._view(attn, rids, facts, [i for i, f in enumerate(facts) if f.level == lvl]) for lvl in levels]
        if levels[0] == 0:
            self.canary.begin_forward(views[0])
            self.canary.pre_forward()
            self.open = True
            views = views[1:]
        self.deferred = views
        self._host(t0)

    def _view(self, attn: Any, rids: list[str], facts: list[ReqFacts], rows: list[int]) -> BatchView:
        """The batch view of some rows (all rows: no copies; a subset: their token ranges gathered)."""
        n, dev = len(rids), attn.block_table.device
        qsl = attn.query_start_loc[:n + 1].to(torch.int64)
        ext = qsl[1:] - qsl[:-1]
        pre = attn.seq_lens[:n] - ext
        nt = sum(f.extend_len for f in facts)
        ids, pos, loc = self.runner.input_ids.gpu[:nt], self.runner.positions[:nt], attn.slot_mapping[:nt]
        if len(rows) < n:
            starts = np.cumsum([0] + [f.extend_len for f in facts])
            tok = torch.from_numpy(np.concatenate([np.arange(starts[i], starts[i + 1]) for i in rows])).to(dev)
            sel = torch.tensor(rows, dtype=torch.int64, device=dev)
            ids, pos, loc, ext, pre = ids[tok], pos[tok], loc[tok], ext[sel], pre[sel]
        return BatchView(
            req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=dev) if len(rows) < n else
            torch.arange(n, dtype=torch.int64, device=dev), prefix_lens=pre, extend_lens=ext,
            req_to_token=attn.block_table[:n], input_ids=ids, positions=pos, out_cache_loc=loc,
            request_ids=[rids[i] for i in rows], req_pool_indices_host=rows,
            prefix_lens_host=[facts[i].prefix_len for i in rows], extend_lens_host=[facts[i].extend_len for i in rows],
            expected_chains=[(facts[i].expect_prefix, facts[i].expect_new) for i in rows])

    def end(self, meta: KVCanaryMetadata | None) -> None:
        """TAIL, the window's report, and the sweep on sweep steps."""
        if self.canary is None:
            return
        t0 = time.perf_counter()
        if self.open:
            self.open = False
            self.canary.post_forward()
            self.canary.end_forward()
            self.stats["forwards"] += 1
        for view in self.deferred:  # rows reading blocks written in this forward: checked now
            with self.canary.forward(view):
                self.canary.pre_forward()
                self.canary.post_forward()
        self.deferred = []
        if meta is not None and meta.export is not None and meta.export.blocks.size:
            self.canary.sweep(self._export(meta.export))
            self.canary.flush()
            self.stats["sweeps"] += 1
        self._host(t0)

    def _host(self, t0: float) -> None:
        us = int(1e6 * (time.perf_counter() - t0))
        self.stats["host_us"] += us
        self.host_us_total += us

    def _export(self, e: CacheExport) -> PrefixCacheExport:
        dev = self.canary.device if self.canary else torch.device("cpu")
        return export_of_blocks(e.blocks, e.first_positions, e.parents, self.block_size, None, dev)

    def _on_report(self, report: WindowReport) -> None:
        self.reports.append(report)
        self.stats["violations"] += report.total
        for v in report.violations:
            if v.slot >= 0:
                self.bad_blocks.add(v.slot // self.block_size)

    def take_bad_blocks(self) -> set[int]:
        out, self.bad_blocks = self.bad_blocks, set()
        return out


# ---------------------------------------------------------------------------------------------------- the connector

class KVCanaryConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """kvcanary as a vLLM KV connector (loads and saves nothing; guards the local paged KV cache)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        """Validate the configuration (errors surface at engine start) and set up the role's side."""
        super().__init__(vllm_config, role, kv_cache_config)
        _check_version()
        self.cfg = connector_config(vllm_config.kv_transfer_config.kv_connector_extra_config)
        self.mode = self.cfg.canary.mode
        if vllm_config.use_v2_model_runner:
            raise VLLMIntegrationError("kvcanary supports vLLM 0.32's V1 model runner: set VLLM_USE_V2_MODEL_RUNNER=0")
        if vllm_config.scheduler_config.async_scheduling:
            raise VLLMIntegrationError("kvcanary needs the tokens of a step when it is scheduled: async_scheduling="
                                       "False")
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self.sched = _SchedulerSide(self.cfg, int(spec.block_size), int(kv_cache_config.num_blocks)) \
            if role == KVConnectorRole.SCHEDULER else None
        self.worker = _WorkerSide(self.cfg, vllm_config, kv_cache_config) if role == KVConnectorRole.WORKER else None
        self._pending_meta: KVCanaryMetadata | None = None
        self.failures: list[Exception] = []  # LOG mode: internal failures that turned the canary off

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """The paged per-layer KV tensors: install the canary over them."""
        if self.worker is not None and self.cfg.canary.mode != CanaryMode.NONE:
            self.worker.register(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """HEAD, before the forward (the scheduler side marks every step as a sync load so it runs first)."""
        meta = self._get_connector_metadata()
        self._pending_meta = meta
        if self.worker is not None:
            self._guarded(self.worker.begin, meta, forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing is loaded."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing is saved per layer (TAIL runs once, in wait_for_save)."""

    def wait_for_save(self) -> None:
        """TAIL after the forward, then the report and sweep."""
        if self.worker is not None:
            self._guarded(self.worker.end, self._pending_meta)
        self._pending_meta = None

    def _guarded(self, fn: Callable[..., None], *args: Any) -> None:
        """Run a bracket half; in LOG mode an internal failure turns the canary off (logged), never the engine."""
        try:
            fn(*args)
        except Exception as e:
            if self.mode == CanaryMode.RAISE or self.worker is None:
                raise
            logger.error("kvcanary: disabled after an internal failure: %r", e, exc_info=e)
            self.failures.append(e)
            self.worker.canary = None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """RAISE mode: the blocks found corrupted this step; vLLM fails the requests holding them
        (kv_load_failure_policy='fail') or recomputes them ('recompute')."""
        if self.worker is None or self.mode != CanaryMode.RAISE:
            return set()
        return set(self.worker.bad_blocks)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """The corrupted blocks, for quarantine on the scheduler side."""
        if self.worker is None:
            return None
        bad = self.worker.take_bad_blocks()
        return KVCanaryWorkerMetadata(bad) if bad else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Counters since the last call (vLLM's logging and Prometheus)."""
        if self.worker is None or not any(self.worker.stats.values()):
            return None
        data, self.worker.stats = self.worker.stats, dict.fromkeys(_STATS_KEYS, 0)
        return KVCanaryStats(data=data)

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """No external KV."""
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Nothing to do."""

    def on_new_request(self, request: Any) -> None:
        """Keep the request: its true tokens are the token truth."""
        if self.sched is not None:
            self.sched.reqs[request.request_id] = request

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """The manager (block ids per request) and its block pool (prefix-cache export, quarantine)."""
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.sched is not None:
            self.sched.manager = kv_cache_manager

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """The block pool."""
        if self.sched is not None:
            self.sched.pool = gpu_block_pool

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """The step's facts and token truth; marks the step as a sync load so HEAD runs before the forward."""
        if self.sched is None:
            raise VLLMIntegrationError("build_connector_meta on a worker-side connector")
        scheduler_output.has_sync_kv_loads = True
        return self.sched.facts(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        """Quarantine the blocks the workers found corrupted."""
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if self.sched is not None and isinstance(meta, KVCanaryWorkerMetadata):
            self.sched.quarantine(meta.blocks)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Release the request's token truth; its blocks are freed as usual."""
        if self.sched is not None:
            self.sched.reqs.pop(request.request_id, None)
            self.sched.forget(request.request_id)
        return False, None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        """Stats objects rebuilt from their dicts."""
        return KVCanaryStats(data=dict(data)) if data is not None else KVCanaryStats(data=dict.fromkeys(_STATS_KEYS, 0))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        """``vllm:kvcanary_*`` counters in vLLM's Prometheus registry."""
        return KVCanaryPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ------------------------------------------------------------------ introspection (tests, diagnostics)

    @property
    def canary(self) -> CanaryManager | None:
        """The worker's kvcanary manager (None on the scheduler side or with mode none)."""
        return self.worker.canary if self.worker is not None else None


