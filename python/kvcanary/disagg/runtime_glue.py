"""The canary on a role's engine: the engine's EngineCanary hooks, the transfer configuration, violation polling."""

from __future__ import annotations

from collections.abc import Sequence

from kvcanary_schema import FingerprintMode, TokenTruth

from kvcanary.adapter import TransferBuffer
from kvcanary.config import CanaryConfig, CanaryMode, HalfCoverage, LayerCoverage
from kvcanary.engine.canary import EngineCanary
from kvcanary.engine.engine import Engine
from kvcanary.engine.hooks import EngineHooks
from kvcanary.report import CallbackSink, Violation, WindowReport


def transfer_config(backend: str = "auto", token_truth: str = "chain", layer_coverage: str = "all") -> CanaryConfig:
    """LOG mode, fingerprints of every byte of K and V; by default of every layer (a truncated transfer misses whole
    layers)
    and with chain token truth (a foreign but self-consistent chain is invisible without it). No seal and no sweeps:
    the coverage is exactly the per-forward one named (the first-layer run is the negative control), so every
    violation is attributed to the request that received the transfer."""
    return CanaryConfig(mode=CanaryMode.LOG, fingerprint=FingerprintMode.ALL, seal=False,
                        layer_coverage=LayerCoverage(layer_coverage), half_coverage=HalfCoverage.EACH,
                        token_truth=TokenTruth[token_truth.upper()],
                        backend=backend, sweep_interval=0, sweep_slice=0, stats_interval=0, req_capacity=64,
                        token_capacity=1024)


class RoleCanary:
    """A canary installed on one role's engine (target pool), as the roles use it."""

    def __init__(self, engine: Engine, config: CanaryConfig) -> None:
        self._found: list[Violation] = []
        self.canary = EngineCanary(engine, config, sinks=[CallbackSink(self._collect)])

    def _collect(self, report: WindowReport) -> None:
        self._found.extend(report.violations)

    @property
    def hooks(self) -> EngineHooks:
        """The hooks installed on the engine."""
        return self.canary

    def transfer_buffers(self) -> Sequence[TransferBuffer]:
        """The runtime's canary record buffers of the target pool."""
        return self.canary.target.transfer_buffers()

    def poll(self, final: bool) -> list[Violation]:
        """Violations reported since the last poll (``final``: collect the windows still in flight first)."""
        if final:
            self.canary.flush()
        out, self._found = self._found, []
        return out


def install_on_engine(engine: Engine, config: CanaryConfig | None = None) -> RoleCanary:
    """Install the canary on an engine (default: the transfer configuration)."""
    return RoleCanary(engine, config if config is not None else transfer_config())
