"""CanaryConfig: every runtime knob in one frozen dataclass, validated, readable from KVCANARY_* variables."""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvcanary_schema import (
    DEFAULT_FP_LAYER_STRIDE,
    DEFAULT_REQ_CAPACITY,
    DEFAULT_RING_CAPACITY,
    DEFAULT_STATS_INTERVAL,
    DEFAULT_SWEEP_CAPACITY,
    DEFAULT_SWEEP_ROLL_INTERVAL,
    DEFAULT_SWEEP_SLICE,
    FingerprintMode,
    TokenTruth,
)

from kvcanary.errors import CanaryInputError
from kvcanary.ops.types import is_power_of_two

ENV_PREFIX = "KVCANARY_"
# Clean windows are cheap to skip and a violation never waits for one (docs/defaults.md): a skipped launch or a graph
# without the canary ops shows within this many forwards. Each clean window costs 150-300 µs of host time on the GPU
# hosts (host_session18): 64 keeps that near 4 µs per forward.
DEFAULT_REPORT_INTERVAL = 64


# Which fault classes only token truth (TokenTruth.CHAIN or POOL) can catch, and the check that does: a
# content-only chain cannot tell a whole wrong-but-self-consistent chain from the right one.
TOKEN_TRUTH_FAULTS: dict[str, str] = {
    "prefix-cache hit on another request's prefix": "VERIFY_TOKEN (EXPECT_PREFIX / pool compare)",
    "two requests' slot lists swapped (slot_swap)": "VERIFY_TOKEN",
    "wrong input token fed to the model (next_token_swap)": "WRITE_TOKEN (EXPECT_NEW / INPUTS assert)",
    "stale or foreign chain transferred whole (prefill->decode)": "VERIFY_TOKEN",
    "token flipped in the newest record before the next write seeds from it": "VERIFY_TOKEN / WRITE_TOKEN",
    "draft pool stored without its +1 token offset": "WRITE_TOKEN",
}
# Caught without token truth: a wrong slot-table entry (req_to_token), use-after-free reuse, canary-record flips,
# real-KV corruption (fingerprints), torn transfers of part of a chain (chain links / positions).


class CanaryMode(enum.StrEnum):
    """What happens on a violation: nothing installed, log it, or raise CanaryViolationError."""

    NONE = "none"
    LOG = "log"
    RAISE = "raise"


class LayerCoverage(enum.StrEnum):
    """Which fingerprint sources (layers) are hashed: the first, all, every ``layer_stride``-th, or exactly one
    per position, rotating with it (ROTATE: source j at position p iff (j + p) % num_sources == 0)."""

    FIRST = "first"
    ALL = "all"
    SAMPLE = "sample"
    ROTATE = "rotate"


class HalfCoverage(enum.StrEnum):
    """Which halves' bytes the per-forward (TAIL) fingerprint hashes: FIRST = the first half's (K) only (one random
    read per slot; the V records' per-forward fingerprint hashes no bytes, damage to V alone is the seal's), EACH =
    every half its own (one read per slot and half)."""

    FIRST = "first"
    EACH = "each"


class CoveragePolicy(enum.StrEnum):
    """Which prefix slots each forward verifies (DESIGN 5)."""

    FULL = "full"
    WINDOW = "window"


class PerturbMode(enum.StrEnum):
    """Self-test corruptions (kvcanary.perturb); each maps to the check that must catch it."""

    REQ_TO_TOKEN = "req_to_token"
    REAL_KV_USED = "real_kv_used"
    REAL_KV_UNUSED_CACHED = "real_kv_unused_cached"
    REAL_KV_POST_FORWARD = "real_kv_post_forward"
    NEXT_TOKEN_SWAP = "next_token_swap"
    SLOT_SWAP = "slot_swap"
    USE_AFTER_FREE = "use_after_free"
    RECORD_FLIP = "record_flip"
    MULTI_BIT_FLIP = "multi_bit_flip"
    TRANSFER_CORRUPTION = "transfer_corruption"


@dataclass(frozen=True)
class PerturbConfig:
    """Perturbation settings: off unless a mode has probability > 0."""

    probabilities: Mapping[PerturbMode, float] = field(default_factory=dict)
    warmup_steps: int = 50
    seed: int = 0

    def __post_init__(self) -> None:
        for mode, p in self.probabilities.items():
            if not isinstance(mode, PerturbMode):
                raise CanaryInputError(f"perturb.probabilities: unknown mode {mode!r}")
            if not 0.0 <= p <= 1.0:
                raise CanaryInputError(f"perturb.probabilities[{mode.value}] must be in [0, 1], got {p}")
        if self.warmup_steps < 0:
            raise CanaryInputError(f"perturb.warmup_steps must be >= 0, got {self.warmup_steps}")

    @property
    def enabled(self) -> bool:
        """True when any mode can fire."""
        return any(p > 0 for p in self.probabilities.values())

    def probability(self, mode: PerturbMode) -> float:
        """Probability of one mode per forward (0 when absent)."""
        return float(self.probabilities.get(mode, 0.0))


@dataclass(frozen=True)
class CanaryConfig:
    """Every knob of the runtime. Invalid values raise CanaryInputError naming the knob."""

    mode: CanaryMode = CanaryMode.LOG
    # The default policy (docs/defaults.md): every verify fingerprints the first 16 bytes of the first layer's K
    # per slot (a whole-slot overwrite changes them); the HEAD records carry a seal (every byte of every layer, K
    # and V); a request's reused prefix is checked against the seal in its first forward; a rolling sweep checks
    # ``sweep_slice`` cached slots per forward against both. (ROTATE, one layer per position, reads randomly across
    # every layer's tensor: 1.42x instead of 1.24x the no-fingerprint GPU time at decode bs 256 prefix 4096;
    # half_coverage EACH doubles the partial reads of a K+V pool: 1.38x instead of 1.22x.)
    fingerprint: FingerprintMode = FingerprintMode.PARTIAL
    layer_coverage: LayerCoverage = LayerCoverage.FIRST
    half_coverage: HalfCoverage = HalfCoverage.FIRST
    layer_stride: int = DEFAULT_FP_LAYER_STRIDE  # used by LayerCoverage.SAMPLE
    # The per-forward (TAIL) fingerprint checks a rotating share 1/fingerprint_share of the verified slots: the slot
    # at position p when (p + prefix_len) % fingerprint_share == 0. A power of two; 1 = every slot every forward.
    # Bound: a decoding request's read slots are each checked within fingerprint_share of its forwards (its
    # prefix_len grows by one per forward); a chunked prefill's chunks of a multiple of it check the same residue
    # class each time. Writes, the seal, the reuse check and sweeps are unaffected. Cost: the 16-byte partial read
    # per verified slot and half divides by it (docs/defaults.md).
    fingerprint_share: int = 1
    coverage: CoveragePolicy = CoveragePolicy.FULL
    # WINDOW policy: the newest ``window_links`` prefix links every forward plus a rotating stripe of
    # ``stripe_size`` older slots per request; worst-case time-to-detect of an older slot's corruption is
    # 2 * ceil((prefix_len - window_links) / stripe_size) forwards of its request (one pass, ceil(...), when the
    # prefix does not grow); idle cached slots are the sweep's (sweep_interval forwards).
    stripe_size: int = 256
    window_links: int = 1
    # seal: the HEAD write moves after the forward and stores a fingerprint of every byte of every layer (ALL mode,
    # all sources) in the HEAD records; sweeps and the reuse check verify it. Needs fingerprint != none.
    seal: bool = True
    reuse_check: bool = True  # a request's first forward verifies its whole reused prefix against the seal
    sweep_interval: int = 0  # forwards between full sweeps of the prefix cache; 0 = off (the rolling sweep is default)
    sweep_slice: int = DEFAULT_SWEEP_SLICE  # rolling sweep: cached slots verified per forward; 0 = off
    # rolling sweep: one slice every sweep_roll_interval forwards, of sweep_roll_interval x sweep_slice slot ids: the
    # export (the engine's, per slice) and the slice's launches are paid once per interval, the GPU work per slot is
    # the same, and one forward in each interval carries it all
    sweep_roll_interval: int = DEFAULT_SWEEP_ROLL_INTERVAL
    sweep_capacity: int = DEFAULT_SWEEP_CAPACITY
    sweep_unlocked_only: bool = False  # sweep only chains no running request holds (the rest are verified per forward)
    token_truth: TokenTruth = TokenTruth.CHAIN
    input_asserts: bool = False  # WriteCheck.INPUTS
    chain_position_assert: bool = True  # WriteCheck.CHAIN_POSITION
    # WriteCheck.STRUCTURAL in the HEAD write of the first group: out_cache_loc must equal req_to_token at each new
    # token's (row, position), padding rows may write only reserved slots (docs/ops-contract.md 5)
    structural_check: bool = True
    ring_capacity: int = DEFAULT_RING_CAPACITY
    # Forwards per clean reporting window (health and watchdog checks, metrics, stats line): the per-forward host cost
    # of staging and decoding a window divides by it. Violation rows are staged at once whatever it is (CPU: reported
    # by the violating forward's end_forward; CUDA: once the ring count copied out after it arrives).
    report_interval: int = DEFAULT_REPORT_INTERVAL
    stats_interval: int = DEFAULT_STATS_INTERVAL  # forwards between stats lines; 0 = off
    watchdog: bool = True
    log_rate_limit: int = 20  # LOG mode: at most this many violation lines per reporting window
    jsonl_path: str | None = None
    req_capacity: int = DEFAULT_REQ_CAPACITY
    token_capacity: int = 8192  # tokens per forward (static input buffers)
    backend: str = "auto"  # auto / torch / cpu / cuda
    # CUDA: an eager forward's pre and post stages each run as one CUDA graph launch, captured once a (stage, shape,
    # slot table) recurs (program.EagerGraphs); off: each kernel launched on its own
    eager_graphs: bool = True
    perturb: PerturbConfig = field(default_factory=PerturbConfig)

    def __post_init__(self) -> None:
        _coerce(self, "mode", CanaryMode)
        _coerce(self, "layer_coverage", LayerCoverage)
        _coerce(self, "half_coverage", HalfCoverage)
        _coerce(self, "coverage", CoveragePolicy)
        if not isinstance(self.fingerprint, FingerprintMode):
            _coerce_named(self, "fingerprint", FingerprintMode)
        if not isinstance(self.token_truth, TokenTruth):
            _coerce_named(self, "token_truth", TokenTruth)
        for knob, low in (("layer_stride", 1), ("stripe_size", 1), ("window_links", 1), ("sweep_interval", 0),
                          ("sweep_slice", 0), ("sweep_roll_interval", 1), ("sweep_capacity", 1), ("ring_capacity", 1),
                          ("report_interval", 1), ("stats_interval", 0), ("log_rate_limit", 0), ("req_capacity", 1),
                          ("token_capacity", 1)):
            value = getattr(self, knob)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise CanaryInputError(f"CanaryConfig.{knob} must be an int >= {low}, got {value!r}")
        for knob in sorted(_BOOL_KNOBS):
            if not isinstance(getattr(self, knob), bool):
                raise CanaryInputError(f"CanaryConfig.{knob} must be a bool, got {getattr(self, knob)!r}")
        if not is_power_of_two(self.fingerprint_share):
            raise CanaryInputError(f"CanaryConfig.fingerprint_share must be a power of two >= 1, got "
                                   f"{self.fingerprint_share!r}")
        if self.sweep_slice * self.sweep_roll_interval > self.sweep_capacity:
            raise CanaryInputError(f"CanaryConfig.sweep_slice x sweep_roll_interval ({self.sweep_slice} x "
                                   f"{self.sweep_roll_interval}) must be <= sweep_capacity ({self.sweep_capacity})")
        if self.backend not in ("auto", "torch", "cpu", "cuda"):
            raise CanaryInputError(f"CanaryConfig.backend must be auto/torch/cpu/cuda, got {self.backend!r}")
        if self.mode == CanaryMode.NONE and self.perturb.enabled:
            raise CanaryInputError("CanaryConfig.perturb needs mode log or raise (mode none installs nothing)")

    def resolved_backend(self, device_type: str) -> str:
        """The backend for data on ``device_type``: ``auto`` is the fastest that loads (_native.auto_backend)."""
        if self.backend != "auto":
            return self.backend
        from kvcanary import _native

        return _native.auto_backend(device_type)

    def layer_stride_for(self, num_sources: int) -> int:
        """Layer stride handed to the fingerprint ops (source j is hashed at p iff (j + p) % stride == 0)."""
        if self.layer_coverage == LayerCoverage.ALL:
            return 1
        if self.layer_coverage == LayerCoverage.SAMPLE:
            return self.layer_stride
        if self.layer_coverage == LayerCoverage.ROTATE:
            return num_sources
        return 1  # FIRST: the manager hands only source 0

    @property
    def sealing(self) -> bool:
        """True when the HEAD records carry the seal: ``seal`` set, fingerprints on, and the per-forward fingerprint
        not already every byte of every layer and half (fingerprint all, layer_coverage all, half_coverage each: the
        seal would repeat it)."""
        full = self.fingerprint == FingerprintMode.ALL and self.layer_coverage == LayerCoverage.ALL and \
            self.half_coverage == HalfCoverage.EACH
        return self.seal and self.fingerprint != FingerprintMode.NONE and not full

    def replace(self, **changes: Any) -> CanaryConfig:
        """A copy with some knobs changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> CanaryConfig:
        """Read KVCANARY_<KNOB> variables (upper-case field names; perturbation: KVCANARY_PERTURB_<MODE>_PROB,
        KVCANARY_PERTURB_WARMUP_STEPS, KVCANARY_PERTURB_SEED); ``overrides`` win over the environment."""
        env = os.environ if environ is None else environ
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name == "perturb":
                continue
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is not None:
                kwargs[f.name] = _parse(f.name, raw, cls)
        probs: dict[PerturbMode, float] = {}
        for mode in PerturbMode:
            raw = env.get(f"{ENV_PREFIX}PERTURB_{mode.value.upper()}_PROB")
            if raw is not None:
                probs[mode] = _parse_float(f"PERTURB_{mode.value.upper()}_PROB", raw)
        pk: dict[str, Any] = {"probabilities": probs}
        for name in ("warmup_steps", "seed"):
            raw = env.get(f"{ENV_PREFIX}PERTURB_{name.upper()}")
            if raw is not None:
                pk[name] = _parse_int(f"PERTURB_{name.upper()}", raw)
        kwargs["perturb"] = PerturbConfig(**pk)
        kwargs.update(overrides)
        return cls(**kwargs)


_INT_KNOBS = {"layer_stride", "fingerprint_share", "stripe_size", "window_links", "sweep_interval", "sweep_slice",
              "sweep_roll_interval", "sweep_capacity", "ring_capacity",
              "report_interval", "stats_interval", "log_rate_limit", "req_capacity", "token_capacity"}
_BOOL_KNOBS = {"input_asserts", "chain_position_assert", "structural_check", "watchdog", "sweep_unlocked_only", "seal",
               "reuse_check", "eager_graphs"}


def _parse(name: str, raw: str, cls: type[CanaryConfig]) -> Any:
    if name in _INT_KNOBS:
        return _parse_int(name.upper(), raw)
    if name in _BOOL_KNOBS:
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise CanaryInputError(f"{ENV_PREFIX}{name.upper()} must be a boolean (1/0/true/false), got {raw!r}")
    if name == "jsonl_path":
        return raw or None
    return raw.strip().lower()


def _parse_int(name: str, raw: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise CanaryInputError(f"{ENV_PREFIX}{name} must be an integer, got {raw!r}") from None


def _parse_float(name: str, raw: str) -> float:
    try:
        return float(raw.strip())
    except ValueError:
        raise CanaryInputError(f"{ENV_PREFIX}{name} must be a number, got {raw!r}") from None


def _coerce(cfg: CanaryConfig, knob: str, enum_cls: type[enum.Enum]) -> None:
    value = getattr(cfg, knob)
    if isinstance(value, enum_cls):
        return
    try:
        object.__setattr__(cfg, knob, enum_cls(str(value).lower()))
    except ValueError:
        allowed = "/".join(str(m.value) for m in enum_cls)
        raise CanaryInputError(f"CanaryConfig.{knob} must be one of {allowed}, got {value!r}") from None


def _coerce_named(cfg: CanaryConfig, knob: str, enum_cls: type[FingerprintMode] | type[TokenTruth]) -> None:
    value = getattr(cfg, knob)
    members = {m.name.lower(): m for m in enum_cls}
    key = str(value).lower()
    if key not in members:
        raise CanaryInputError(f"CanaryConfig.{knob} must be one of {'/'.join(members)}, got {value!r}")
    object.__setattr__(cfg, knob, members[key])
