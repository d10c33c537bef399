"""kvcanary hosted in the reference engine: the adapter (pool, batch, prefix cache) and the per-forward bracket."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from kvcanary_schema import NO_SLOT, TOKEN_LIMIT, Group

from kvcanary.adapter import BatchView, GroupSpec, PoolDescription, PrefixCacheExport
from kvcanary.config import CanaryConfig
from kvcanary.manager import CanaryManager, install
from kvcanary.ops.types import SourceSpec
from kvcanary.report import ReportSink, Violation, WindowReport
from kvcanary.truth import new_token_truth

from .batch import ForwardBatch, PoolKind
from .engine import Engine
from .pool import PoolView
from .radix import CachedChains


def _sources(tensors: Sequence[torch.Tensor], layers: Sequence[int]) -> list[SourceSpec]:
    return [SourceSpec(tensors[layer]) for layer in layers]


def pool_description(view: PoolView, device: torch.device) -> PoolDescription:
    """The kvcanary pool description of one engine pool: a FULL group, plus an SWA group when it has sliding layers.

    The SWA group's slots are the SWA pool's rows, reached through the engine's full->SWA map (-1 = evicted).
    """
    groups = [GroupSpec(Group.FULL, view.num_slots, 2, view.reserved_slots,
                        sources=[_sources(view.k, view.full_layers), _sources(view.v, view.full_layers)])]
    if view.swa_layers:
        groups.append(GroupSpec(Group.SWA, view.num_swa_slots, 2, view.reserved_slots, swa_map=view.full_to_swa,
                                window=view.swa_window,
                                sources=[_sources(view.k, view.swa_layers), _sources(view.v, view.swa_layers)]))
    rows, cols = view.req_to_token.shape
    return PoolDescription(num_slots=view.num_slots, req_rows=int(rows), max_context=int(cols), groups=groups,
                           device=device, page_size=view.page_size,
                           padding_row=-1 if view.padding_row is None else view.padding_row,
                           token_offset=view.token_offset)


# Token truth for target-pool positions past the committed history: no true token exists there (a correct
# engine's target prefix always ends before the last committed token), and no real token equals this one.
NO_TRUE_TOKEN = TOKEN_LIMIT - 1


def _truth(batch: ForwardBatch) -> tuple[tuple[int, ...], ...]:
    """Each row's true history; in the target pool a prefix running past it is padded with NO_TRUE_TOKEN, so the
    boundary check reports KV read beyond the request's logical length (a trimmed tail still read)."""
    if batch.token_offset != 0:
        return batch.histories
    out = []
    for hist, pre in zip(batch.histories, batch.prefix_lens_host, strict=False):
        out.append(hist + (NO_TRUE_TOKEN,) * (pre - len(hist)) if pre > len(hist) else hist)
    return tuple(out)


def batch_view(batch: ForwardBatch) -> BatchView:
    """The kvcanary view of one engine forward (padding rows carry no request id and no token truth)."""
    pad = batch.num_padding
    truth = (*_truth(batch), *([()] * pad))
    return BatchView(
        req_pool_indices=batch.req_pool_indices, prefix_lens=batch.prefix_lens, extend_lens=batch.extend_lens,
        req_to_token=batch.req_to_token, input_ids=batch.input_ids, positions=batch.positions,
        out_cache_loc=batch.out_cache_loc, request_ids=(*batch.req_ids, *([None] * pad)),
        req_pool_indices_host=batch.req_pool_indices_host, prefix_lens_host=batch.prefix_lens_host,
        extend_lens_host=batch.extend_lens_host, true_tokens=truth, token_offset=batch.token_offset,
        true_new_tokens=new_token_truth(truth, batch.prefix_lens_host, batch.extend_lens_host, batch.num_tokens,
                                        batch.token_offset))


def _engine_chains(engine: Engine, kind: PoolKind) -> CachedChains | None:
    """The engine's radix cache (and, in the target pool, the running requests' uncached KV) as chains (None without a
    prefix cache)."""
    if engine.radix is None:
        return None
    # the target pool's export also holds every running request's KV outside the cache (a sweep reaches it)
    return engine.resident_chains() if kind == PoolKind.TARGET else engine.cached_chains()


def _chains_export(engine: Engine, kind: PoolKind, c: CachedChains) -> PrefixCacheExport:
    """``c`` as the sweep's chain export of pool ``kind``.

    In the draft pool (token offset 1) a node's last record holds the first token of whichever child wrote it
    first, so links across node boundaries are not content-determined there: the draft export gives non-root
    chains a predecessor that does not resolve (verify then skips that one link, uncounted, per the contract)."""
    prev = c.prev_slots
    if kind == PoolKind.DRAFT:
        prev = torch.where(prev == NO_SLOT, prev, torch.full_like(prev, engine.config.num_slots))
    return PrefixCacheExport(c.slots, c.chain_starts, c.chain_lens, c.first_positions, prev, c.unlocked,
                             holders=c.holders)


@dataclass(frozen=True)
class Detection:
    """One canary report with violations: its pool, the engine forward (both pools counted) and the pool's step."""

    pool: PoolKind
    forward: int
    step: int
    report: WindowReport


@dataclass
class ForwardLog:
    """What the hooks saw: per engine forward, the pool and the request ids (for latency per request)."""

    pools: list[PoolKind] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # the pool manager's step of each forward
    requests: list[tuple[str, ...]] = field(default_factory=list)


class EngineCanary:
    """EngineHooks that run kvcanary around every forward of a reference engine (target and draft pool).

    One manager per pool: the target pool (FULL + SWA groups) and the EAGLE-style draft pool (FULL group,
    token offset 1), which shares the target's slot indices and prefix cache. Freed slots have their records
    invalidated, so any later read of a freed slot fails its checks (use-after-free, wrong rollback).
    """

    def __init__(self, engine: Engine, config: CanaryConfig, sinks: Sequence[ReportSink] = (),
                 on_forward: Callable[[EngineCanary, ForwardBatch, PoolKind], None] | None = None,
                 quarantine: bool = True) -> None:
        """Install one manager per pool and become ``engine``'s hooks; ``on_forward`` runs after every bracket;
        ``quarantine``: reported bad slots leave the prefix cache (evicted, recomputed on the next use)."""
        self.engine = engine
        self.config = config
        self.quarantine = quarantine
        self.managers: dict[PoolKind, CanaryManager] = {}
        # windows with violations as the managers collect them (in begin_forward or end_forward: reports arrive when
        # their copies do), kept and acted on after the forward
        self._inbox: list[tuple[PoolKind, WindowReport]] = []
        kinds = [PoolKind.TARGET] + ([PoolKind.DRAFT] if engine.models.draft_pool is not None else [])
        for kind in kinds:
            desc = pool_description(engine.pool_view(kind), engine.device)
            # the draft pool sees the same prefix cache; only the target's records get perturbed
            self.managers[kind] = install(desc, config if kind == PoolKind.TARGET else _unperturbed(config),
                                          prefix_cache=partial(self._export, kind),
                                          sinks=[*sinks, partial(self._receive, kind)])
        self.detections: list[Detection] = []
        self.log = ForwardLog()
        self.forwards = 0
        self.seconds = 0.0  # wall time spent inside the canary's hooks (host work + CPU kernels)
        self.export_seconds = 0.0  # the part of it spent in the engine's prefix-cache export (the sweep's input)
        self._exports: dict[PoolKind, tuple[CachedChains, PrefixCacheExport]] = {}  # per pool: the last export
        self._global: dict[tuple[PoolKind, int], int] = {}  # (pool, pool step) -> engine forward
        self._on_forward = on_forward
        engine.hooks = self

    @classmethod
    def attach(cls, engine: Engine, config: CanaryConfig | None = None, **kwargs: object) -> EngineCanary:
        """Install kvcanary on ``engine`` (replacing its hooks); ``config`` defaults to CanaryConfig.from_env()."""
        return cls(engine, config if config is not None else CanaryConfig.from_env(), **kwargs)  # type: ignore[arg-type]

    @property
    def target(self) -> CanaryManager:
        """The target pool's manager."""
        return self.managers[PoolKind.TARGET]

    # ------------------------------------------------------------------ EngineHooks

    def before_forward(self, batch: ForwardBatch, pool_kind: PoolKind) -> None:
        """begin_forward (host: token truth, perturbation) and pre_forward (plan, HEAD verify + write)."""
        t0 = time.perf_counter()
        self.forwards += 1
        self.log.pools.append(pool_kind)
        self.log.requests.append(batch.req_ids)
        m = self.managers[pool_kind]
        self.log.steps.append(m.forwards + 1)
        self._global[(pool_kind, m.forwards + 1)] = self.forwards
        m.begin_forward(batch_view(batch))
        m.pre_forward()
        self.seconds += time.perf_counter() - t0

    def after_forward(self, batch: ForwardBatch, pool_kind: PoolKind) -> None:
        """post_forward (TAIL verify + write with fingerprints) and end_forward (sweep, report)."""
        t0 = time.perf_counter()
        m = self.managers[pool_kind]
        m.post_forward()
        m.end_forward()
        self._keep()
        self.seconds += time.perf_counter() - t0
        if self._on_forward is not None:
            self._on_forward(self, batch, pool_kind)

    def on_alloc(self, slots: torch.Tensor) -> None:
        """Nothing to do: new slots get records when their KV is written."""

    def on_free(self, slots: torch.Tensor) -> None:
        """Invalidate the records of freed slots in every pool (FULL groups; SWA slots are freed via the map)."""
        t0 = time.perf_counter()
        for m in self.managers.values():
            m.invalidate(slots)
        self.seconds += time.perf_counter() - t0

    # ------------------------------------------------------------------ results

    def _export(self, kind: PoolKind) -> PrefixCacheExport | None:
        """The pool's prefix-cache export (each manager's ``prefix_cache``; None without a prefix cache): the same
        object while the engine returns the same chains (the rolling sweep then derives nothing new)."""
        t0 = time.perf_counter()
        chains = _engine_chains(self.engine, kind)
        last = self._exports.get(kind)
        if chains is not None and (last is None or last[0] is not chains):
            last = self._exports[kind] = (chains, _chains_export(self.engine, kind, chains))
        self.export_seconds += time.perf_counter() - t0
        return None if chains is None or last is None else last[1]

    def _receive(self, kind: PoolKind, report: WindowReport) -> None:
        self._inbox.append((kind, report))

    def _keep(self) -> None:
        """Keep the windows received since the last call, each dated by the step of its first violation row (the
        forward whose check fired; the window itself may end forwards later), and act on their quarantine: the
        engine stops reusing those cached slots (a bad block is a cache miss)."""
        for kind, report in self._inbox:
            step = min((v.step for v in report.violations), default=report.last_step)
            self.detections.append(Detection(kind, self._global.get((kind, step), self.forwards), step, report))
            if self.quarantine:
                self.engine.quarantine(report.quarantine)
        self._inbox.clear()

    def flush(self) -> None:
        """Collect every window still in flight (blocking)."""
        for m in self.managers.values():
            m.flush()
        self._keep()

    def sweep(self) -> None:
        """Sweep every pool's prefix cache now (eager) and collect the result."""
        for m in self.managers.values():
            if m.enabled and m.sweep():
                m.flush()
        self._keep()

    def violations(self) -> list[Violation]:
        """Every kept violation row so far."""
        return [v for d in self.detections for v in d.report.violations]

    @property
    def total(self) -> int:
        """Exact number of violations so far (all pools)."""
        return sum(d.report.total for d in self.detections)


def _unperturbed(config: CanaryConfig) -> CanaryConfig:
    if not config.perturb.enabled:
        return config
    return config.replace(perturb=type(config.perturb)())
