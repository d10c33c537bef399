"""Minimal glue between the reference engine and the canary runtime: pool description, hooks, violation polling."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from kvcanary_schema import FingerprintMode, Group, TokenTruth

from kvcanary.adapter import BatchView, GroupSpec, PoolDescription, TransferBuffer
from kvcanary.config import CanaryConfig, CanaryMode, LayerCoverage
from kvcanary.engine.batch import ForwardBatch, PoolKind
from kvcanary.engine.engine import Engine
from kvcanary.manager import CanaryManager, install
from kvcanary.ops.types import SourceSpec
from kvcanary.report import CallbackSink, Violation, WindowReport


def describe_pool(engine: Engine) -> PoolDescription:
    """The target pool of a reference engine: a FULL group and, with sliding layers, an SWA group; K and V halves,
    every layer a fingerprint source."""
    view = engine.pool_view(PoolKind.TARGET)

    def sources(layers: Sequence[int]) -> list[list[SourceSpec]]:
        return [[SourceSpec(view.k[i]) for i in layers], [SourceSpec(view.v[i]) for i in layers]]

    groups = [GroupSpec(Group.FULL, view.num_slots, 2, view.reserved_slots, sources=sources(view.full_layers))]
    if view.swa_layers:
        groups.append(GroupSpec(Group.SWA, view.num_swa_slots, 2, view.reserved_slots, view.full_to_swa,
                                view.swa_window, sources(view.swa_layers)))
    return PoolDescription(view.num_slots, int(view.req_to_token.shape[0]), int(view.req_to_token.shape[1]), groups,
                           view.req_to_token.device, view.page_size,
                           -1 if view.padding_row is None else view.padding_row, view.token_offset)


def batch_view(batch: ForwardBatch) -> BatchView:
    """The adapter's view of one engine forward (padding rows carry no request id and no truth)."""
    pad = batch.num_padding
    return BatchView(batch.req_pool_indices, batch.prefix_lens, batch.extend_lens, batch.req_to_token,
                     batch.input_ids, batch.positions, batch.out_cache_loc, (*batch.req_ids, *([None] * pad)),
                     batch.req_pool_indices_host, batch.prefix_lens_host, batch.extend_lens_host,
                     (*batch.histories, *([()] * pad)), batch.token_offset)


def transfer_config(backend: str = "auto") -> CanaryConfig:
    """LOG mode, fingerprints of every byte of every layer (a truncated transfer misses whole layers), chain truth."""
    return CanaryConfig(mode=CanaryMode.LOG, fingerprint=FingerprintMode.ALL, layer_coverage=LayerCoverage.ALL,
                        token_truth=TokenTruth.CHAIN, backend=backend, sweep_interval=0, stats_interval=0,
                        req_capacity=64, token_capacity=1024)


class _Hooks:
    """Engine hooks running the manager's bracket around every target forward."""

    def __init__(self, manager: CanaryManager) -> None:
        self.manager = manager

    def before_forward(self, batch: ForwardBatch, pool_kind: PoolKind) -> None:
        """begin_forward + pre_forward (HEAD verify and write)."""
        if pool_kind == PoolKind.TARGET:
            self.manager.begin_forward(batch_view(batch))
            self.manager.pre_forward()

    def after_forward(self, batch: ForwardBatch, pool_kind: PoolKind) -> None:
        """post_forward (TAIL verify and write with fingerprints) + end_forward."""
        if pool_kind == PoolKind.TARGET:
            self.manager.post_forward()
            self.manager.end_forward()

    def on_alloc(self, slots: torch.Tensor) -> None:
        """Nothing to do: new slots are written before they are read."""

    def on_free(self, slots: torch.Tensor) -> None:
        """Nothing to do."""


class EngineCanary:
    """A canary installed on a reference engine's target pool, as a disagg role uses it."""

    def __init__(self, engine: Engine, config: CanaryConfig) -> None:
        self._found: list[Violation] = []
        self.manager = install(describe_pool(engine), config, sinks=[CallbackSink(self._collect)])
        self._hooks = _Hooks(self.manager)
        engine.hooks = self._hooks

    def _collect(self, report: WindowReport) -> None:
        self._found.extend(report.violations)

    @property
    def hooks(self) -> _Hooks:
        """The hooks installed on the engine."""
        return self._hooks

    def transfer_buffers(self) -> Sequence[TransferBuffer]:
        """The runtime's canary record buffers."""
        return self.manager.transfer_buffers()

    def poll(self, final: bool) -> list[Violation]:
        """Violations reported since the last poll (``final``: flush the open window first)."""
        if final:
            self.manager.flush()
        out, self._found = self._found, []
        return out


def install_on_engine(engine: Engine, backend: str = "auto") -> EngineCanary:
    """Install the canary with the transfer configuration on an engine."""
    return EngineCanary(engine, transfer_config(backend))
