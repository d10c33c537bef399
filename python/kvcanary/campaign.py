"""Fault campaigns on the reference engine: inject each bug class, check the canary reports it, and clean soaks."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from kvcanary_schema import FailReason, FingerprintMode, Stage

from kvcanary.config import CanaryConfig, CanaryMode, HalfCoverage, LayerCoverage, PerturbConfig, PerturbMode
from kvcanary.engine import (
    IDLE_VICTIM,
    Engine,
    EngineConfig,
    EngineHooks,
    FaultConfig,
    ForwardBatch,
    ModelConfig,
    NullHooks,
    PoolExhaustedError,
    PoolKind,
    Request,
    SamplingParams,
)
from kvcanary.engine.canary import EngineCanary
from kvcanary.perturb import EXPECTED
from kvcanary.report import Violation, reason_names

Workload = Callable[[Engine, random.Random], None]

TARGET_MODEL = ModelConfig(num_layers=3, sliding_layers=(1,), sliding_window=48, seed=1)
DRAFT_MODEL = ModelConfig(num_layers=1, hidden=32, intermediate=64, num_heads=2, num_kv_heads=1, seed=7)
VOCAB = TARGET_MODEL.vocab_size


# ---------------------------------------------------------------------------------------------- workloads

def _prompt(rng: random.Random, n: int, prefix: Sequence[int] = ()) -> tuple[int, ...]:
    return tuple(prefix) + tuple(rng.randrange(VOCAB) for _ in range(n))


def _sampling(rng: random.Random) -> SamplingParams:
    # temperature 1 (seeded): greedy decoding of a random model often repeats the predicted token and hides bugs
    return SamplingParams(1.0, seed=rng.randrange(1 << 30))


def two_turns(engine: Engine, rng: random.Random) -> None:
    """A, then B (a prefix-cache miss that may be served wrongly), then A again with two more tokens (a hit)."""
    a = Request("a", _prompt(rng, 12), 6, _sampling(rng))
    engine.generate([a])
    engine.generate([Request("b", _prompt(rng, 12), 6, _sampling(rng))])
    engine.generate([Request("a2", a.prompt + (1, 2), 4, _sampling(rng))])


def batch(engine: Engine, rng: random.Random) -> None:
    """Three requests of different lengths decoded together."""
    engine.generate([Request(f"r{i}", _prompt(rng, 12 + i), 10, _sampling(rng)) for i in range(3)])


def retract_in_decode(engine: Engine, rng: random.Random) -> None:
    """One request retracted in the middle of its decode, resumed (re-prefilled in chunks) and finished."""
    engine.add_request(Request("r0", _prompt(rng, 10), 30, _sampling(rng)))
    for _ in range(12):
        engine.step()
    engine.retract("r0")
    engine.run_until_done()


def shared_waves(engine: Engine, rng: random.Random) -> None:
    """Two waves of same-length requests sharing a prefix (cache hits, equal prefix lengths, cached chains)."""
    prefix = _prompt(rng, 8)
    engine.generate([Request(f"w0-{i}", _prompt(rng, 8, prefix), 8, _sampling(rng)) for i in range(3)])
    engine.generate([Request(f"w1-{i}", _prompt(rng, 8, prefix), 8, _sampling(rng)) for i in range(3)])


WORKLOADS: dict[str, Workload] = {"two_turns": two_turns, "batch": batch, "retract_in_decode": retract_in_decode,
                                  "shared_waves": shared_waves}


def mixed_workload(engine: Engine, rng: random.Random, num_requests: int, max_forwards: int | None = None) -> None:
    """A realistic random mix: shared system prompts (prefix reuse), long prompts (chunked prefill), short chats,
    arrivals while others decode, occasional retracts; eviction and SWA windows come from the pool sizes.
    Stops early after ``max_forwards`` forwards (target + draft) when given."""
    systems = [_prompt(rng, rng.randrange(8, 40)) for _ in range(3)]
    pending = []
    for i in range(num_requests):
        sys_prompt = rng.choice(systems) if rng.random() < 0.7 else ()
        pending.append(Request(f"m{i}", _prompt(rng, rng.randrange(2, 48), sys_prompt), rng.randrange(2, 24),
                               _sampling(rng)))
    while pending or engine.scheduler.running or engine.scheduler.waiting:
        if max_forwards is not None and engine.stats.forwards + engine.stats.draft_forwards >= max_forwards:
            return
        for _ in range(rng.randrange(0, 3)):
            if pending:
                engine.add_request(pending.pop(0))
        if not engine.scheduler.running and not engine.scheduler.waiting and pending:
            engine.add_request(pending.pop(0))
        if engine.scheduler.running and rng.random() < 0.02:
            victim = rng.choice(engine.scheduler.running)
            if not victim.in_prefill:
                engine.retract(victim.rid)
        if not engine.step() and not engine.scheduler.running and engine.scheduler.waiting:
            raise PoolExhaustedError("waiting requests cannot be admitted")


# ---------------------------------------------------------------------------------------------- cases

_PER_FORWARD = "per-forward"
_SWEEP = "sweep"


@dataclass(frozen=True)
class FaultCase:
    """One fault: how it is injected, which bug class it stands for, and what must catch it (stage, reasons)."""

    name: str
    bug_class: str
    workload: str
    needs: str  # what detection depends on: chain/position checks, token truth, fingerprints, the sweep
    detect: str  # "per-forward" (bound: the request's next forward of that pool) or "sweep" (one interval)
    stages: tuple[Stage, ...]
    reasons: FailReason
    engine_fault: str | None = None  # a FaultConfig switch of the engine
    perturb: PerturbMode | None = None  # a runtime perturbation mode
    engine: tuple[tuple[str, Any], ...] = ()  # EngineConfig overrides
    spec: bool = False
    expect_request: str | None = None  # the request the violation must be attributed to, where fixed
    on_padding: bool = False  # the violation names the padding row (whoever owns the slot is the victim)
    bound: int = 1  # forwards to detect (per-forward: of the request in that pool; sweep: of the pool)


_SWEEP_INTERVAL = 4
_SPEC = (("chunk_size", 8), ("spec_num_draft", 3))
_R = FailReason

ENGINE_CASES: tuple[FaultCase, ...] = (
    FaultCase("wrong_prefix_hit", "#1 prefix-cache hit on the wrong prefix", "two_turns", "token truth",
              _PER_FORWARD, (Stage.HEAD,), _R.VERIFY_TOKEN, engine_fault="wrong_prefix_hit",
              engine=(("chunk_size", 8),), expect_request="b", bound=0),
    FaultCase("use_after_free", "#2 use-after-free (cached pages handed out again)", "two_turns",
              "chain + invalidate on free", _SWEEP, (Stage.SWEEP, Stage.HEAD),
              _R.VERIFY_CHAIN | _R.VERIFY_POSITION, engine_fault="use_after_free", engine=(("chunk_size", 8),),
              bound=_SWEEP_INTERVAL),
    FaultCase("block_boundary_off_by_one", "#3 block-boundary off-by-one (write to previous page)", "batch",
              "chain / position (structural check first)", _PER_FORWARD, (Stage.HEAD, Stage.TAIL),
              _R.STRUCTURAL | _R.VERIFY_CHAIN | _R.VERIFY_POSITION | _R.VERIFY_FINGERPRINT,
              engine_fault="block_boundary_off_by_one", engine=(("chunk_size", 8), ("page_size", 4))),
    # the padding row's PADDING segment: its token may write only a reserved slot (HEAD write, the same forward)
    FaultCase("padding_write_live_slot", "#4/#11 padding row writes a live slot", "batch", "structural check",
              _PER_FORWARD, (Stage.HEAD,), _R.STRUCTURAL, engine_fault="padding_write_live_slot",
              engine=(("chunk_size", 8), ("decode_pad_multiple", 4)), on_padding=True, bound=0),
    FaultCase("stale_out_cache_loc", "#4 out_cache_loc disagrees with req_to_token (KV lands in a free slot)",
              "batch", "structural check", _PER_FORWARD, (Stage.HEAD,), _R.STRUCTURAL,
              engine_fault="stale_out_cache_loc", engine=(("chunk_size", 8),), bound=0),
    FaultCase("spec_rollback_wrong_slots", "#10 speculative rollback frees a live page", "batch",
              "chain + invalidate on free", _PER_FORWARD, (Stage.HEAD,),
              _R.VERIFY_CHAIN | _R.VERIFY_POSITION, engine_fault="spec_rollback_wrong_slots", engine=_SPEC, spec=True),
    FaultCase("spec_stale_draft", "#10 rejected draft slot not invalidated", "batch", "token truth",
              _PER_FORWARD, (Stage.HEAD,), _R.VERIFY_TOKEN | _R.WRITE_TOKEN, engine_fault="spec_stale_draft",
              engine=_SPEC, spec=True),
    FaultCase("trimmed_tail_still_read", "#12 trimmed tail still read", "batch", "token truth",
              _PER_FORWARD, (Stage.HEAD,), _R.VERIFY_TOKEN | _R.WRITE_TOKEN | _R.VERIFY_POSITION,
              engine_fault="trimmed_tail_still_read", engine=_SPEC, spec=True),
    FaultCase("draft_position_off_by_one", "SGLang bug 1: draft positions off by one", "batch",
              "chain-position assert", _PER_FORWARD, (Stage.HEAD,), _R.WRITE_POSITION,
              engine_fault="draft_position_off_by_one", engine=_SPEC, spec=True, bound=0),
    FaultCase("draft_chunk_predicted_token", "SGLang bug 2: draft KV of the predicted token at a chunk boundary",
              "batch", "token truth", _PER_FORWARD, (Stage.HEAD,), _R.WRITE_TOKEN,
              engine_fault="draft_chunk_predicted_token", engine=(("chunk_size", 5), ("spec_num_draft", 2)),
              spec=True, bound=0),
    FaultCase("resume_prompt_only_lookup", "SGLang bug 3: after retract+resume, next chunk token from the prompt only",
              "retract_in_decode", "token truth", _PER_FORWARD, (Stage.HEAD,), _R.WRITE_TOKEN,
              engine_fault="resume_prompt_only_lookup",
              engine=(("chunk_size", 4), ("spec_num_draft", 2), ("enable_prefix_cache", False)), spec=True,
              expect_request="r0", bound=0),
    # bit rot at rest (issue 14): a single flipped mantissa bit anywhere in a cached slot's K/V rows
    FaultCase("cached_kv_flip_reused", "#13 V of the last layer of a cached prefix slot bit-flipped, then reused",
              "two_turns", "fingerprint (all layers, all bytes: the seal / fingerprint all)", _PER_FORWARD,
              (Stage.TAIL,), _R.VERIFY_FINGERPRINT, engine_fault="cached_kv_flip_reused", expect_request="a2",
              bound=0),
    FaultCase("cached_kv_flip_idle", "#13 bit flip in an idle cached prefix (any layer, K or V)", "two_turns",
              "fingerprint (all layers, all bytes), sweep", _SWEEP, (Stage.SWEEP,), _R.VERIFY_FINGERPRINT,
              engine_fault="cached_kv_flip_idle", bound=_SWEEP_INTERVAL),
)


def _perturb_case(mode: PerturbMode, bug_class: str) -> FaultCase:
    exp = EXPECTED[mode]
    sweep = exp.stage == Stage.SWEEP
    needs = exp.needs or "chain / position"
    stages = (Stage.HEAD, Stage.TAIL) if mode == PerturbMode.RECORD_FLIP else (exp.stage,)  # the flipped buffer's
    return FaultCase(f"perturb:{mode.value}", bug_class, "shared_waves", needs, _SWEEP if sweep else _PER_FORWARD,
                     stages, exp.reason, perturb=mode, engine=(("chunk_size", 8),),
                     bound=_SWEEP_INTERVAL if sweep else (1 if "next forward" in exp.when else 0))


PERTURB_CASES: tuple[FaultCase, ...] = (
    _perturb_case(PerturbMode.REQ_TO_TOKEN, "#4 stale / wrong slot-table entry"),
    _perturb_case(PerturbMode.REAL_KV_USED, "#13 KV corrupted in a slot being read"),
    _perturb_case(PerturbMode.REAL_KV_UNUSED_CACHED, "#13 bit rot at rest in an idle cached block"),
    _perturb_case(PerturbMode.REAL_KV_POST_FORWARD, "#13 KV corrupted right after it was written"),
    _perturb_case(PerturbMode.NEXT_TOKEN_SWAP, "#1 wrong token fed (requests' tokens swapped)"),
    _perturb_case(PerturbMode.SLOT_SWAP, "#1/#5 two requests' prefixes swapped (self-consistent chains)"),
    _perturb_case(PerturbMode.USE_AFTER_FREE, "#2 a live slot handed to another request's write"),
    _perturb_case(PerturbMode.RECORD_FLIP, "#13 bit flip in a canary record"),
    _perturb_case(PerturbMode.MULTI_BIT_FLIP, "#13 multi-bit non-NaN flip in KV"),
)

CASES: tuple[FaultCase, ...] = ENGINE_CASES + PERTURB_CASES
CASES_BY_NAME: dict[str, FaultCase] = {c.name: c for c in CASES}


def select(names: str) -> list[FaultCase]:
    """Cases by a comma-separated list of names (``perturb:`` prefix optional), or ``all`` / ``none``."""
    if names.strip().lower() in ("", "none"):
        return []
    if names.strip().lower() == "all":
        return list(CASES)
    out = []
    for raw in names.split(","):
        name = raw.strip()
        case = CASES_BY_NAME.get(name) or CASES_BY_NAME.get(f"perturb:{name}")
        if case is None:
            raise ValueError(f"unknown fault {name!r}; known: {', '.join(CASES_BY_NAME)}")
        out.append(case)
    return out


# ---------------------------------------------------------------------------------------------- trials

def canary_config(backend: str = "torch", **changes: Any) -> CanaryConfig:
    """The campaign's canary: LOG mode, fingerprints of every layer and half, token truth, a short full-sweep
    interval."""
    base = CanaryConfig(mode=CanaryMode.LOG, fingerprint=FingerprintMode.ALL, layer_coverage=LayerCoverage.ALL,
                        half_coverage=HalfCoverage.EACH,
                        sweep_interval=_SWEEP_INTERVAL, sweep_slice=0, backend=backend, stats_interval=0,
                        req_capacity=64, token_capacity=1024, log_rate_limit=0)
    return base.replace(**changes) if changes else base


def default_config(backend: str = "torch", **changes: Any) -> CanaryConfig:
    """``CanaryConfig()``'s detection policy (docs/defaults.md) with the campaign's housekeeping: LOG mode, no stats
    lines, capacities sized for the small engine, every violation logged."""
    base = CanaryConfig(mode=CanaryMode.LOG, backend=backend, stats_interval=0, req_capacity=64, token_capacity=1024,
                        log_rate_limit=0)
    return base.replace(**changes) if changes else base


POLICIES: dict[str, Callable[..., CanaryConfig]] = {"campaign": canary_config, "default": default_config}


def sweep_bound(config: CanaryConfig, num_slots: int) -> int:
    """Forwards of a pool within which a sweep verifies an idle cached slot: the full sweep's interval, or the
    rolling sweep's ``interval x ceil(num_slots / (interval x sweep_slice))`` (its slices come every
    ``sweep_roll_interval`` forwards; the smaller bound where both run)."""
    bounds = [config.sweep_interval] if config.sweep_interval else []
    if config.sweep_slice:
        every = config.sweep_roll_interval
        bounds.append(every * -(-num_slots // (every * config.sweep_slice)))
    return min(bounds, default=-1)


def build_engine(case_engine: Sequence[tuple[str, Any]] = (), spec: bool = False, device: str = "cpu",
                 faults: FaultConfig | None = None, **overrides: Any) -> Engine:
    """The campaign's engine: SWA target model (+ draft model when ``spec``), small pool."""
    kwargs: dict[str, Any] = {"num_slots": 1024, "num_swa_slots": 512, "max_reqs": 16, "max_context": 256}
    kwargs.update(dict(case_engine))
    kwargs.update(overrides)
    return Engine(EngineConfig(**kwargs), TARGET_MODEL, DRAFT_MODEL if spec else None, device=device, faults=faults)


@dataclass
class TrialResult:
    """What one fault trial observed."""

    case: str
    seed: int
    fired: bool  # the fault fired and damaged something (engine faults: per the bookkeeping oracle)
    detected: bool
    false_positive: bool  # a violation before the fault fired
    no_effect: bool = False  # the fault fired but changed nothing (not a trial of the canary)
    first_check: str = ""  # tag and reasons of the first row reported after the fault
    tag: str = ""  # the expected check's row: tag, reasons, request
    reasons: list[str] = field(default_factory=list)
    request: str | None = None
    pool: str = ""
    fire_forward: int = 0
    detect_forward: int = 0
    forwards_to_detect: int = -1
    stage_ok: bool = False
    reason_ok: bool = False
    request_ok: bool = False
    within_bound: bool = False
    bound: int = 0
    forwards: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Detected by the expected check, attributed correctly, in time, and nothing reported before the fault."""
        return (self.fired and self.detected and not self.false_positive and self.stage_ok and self.reason_ok
                and self.request_ok and self.within_bound)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {**asdict(self), "ok": self.ok}


_CACHE = "<prefix cache>"


class BookkeepingOracle(NullHooks):
    """An independent ground truth for the campaign (not the canary): per pool and slot the (token, position) last
    written, checked against each request's true history on every read and write. It tells whether an injected
    engine fault really damaged the bookkeeping (a fault can fire without effect, e.g. a predicted token that
    equals the true one) and which requests were hit."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.records = {kind: torch.full((engine.config.num_slots, 2), -1, dtype=torch.int64) for kind in PoolKind}
        self.forwards = 0
        self.first_forward = 0
        self.victims: set[str] = set()

    def _flag(self, rid: str) -> None:
        self.victims.add(rid)
        if not self.first_forward:
            self.first_forward = self.forwards

    def before_forward(self, batch: ForwardBatch, pool_kind: PoolKind) -> None:
        """Check the prefix cache, and every request's prefix (in the target pool: ending inside its history)."""
        self.forwards += 1
        rec, off = self.records[pool_kind], batch.token_offset
        radix = self.engine.radix
        if pool_kind == PoolKind.TARGET and radix is not None:
            for node in radix.nodes():
                got = rec[node.value]
                key = torch.tensor(node.key, dtype=torch.int64)
                if bool(((got[:, 0] != key) | (got[:, 1] != torch.arange(node.start, node.end))).any()):
                    self._flag(_CACHE)
        table = batch.req_to_token.cpu()
        for i in range(batch.real_batch_size):
            pre, hist = batch.prefix_lens_host[i], torch.tensor(batch.histories[i], dtype=torch.int64)
            n = max(0, min(pre, hist.numel() - off))
            got = rec[table[batch.req_pool_indices_host[i], :n]]
            if (off == 0 and pre > hist.numel()) or bool(((got[:, 0] != hist[off:off + n]) |
                                                          (got[:, 1] != torch.arange(n))).any()):
                self._flag(batch.req_ids[i])

    def after_forward(self, batch: ForwardBatch, pool_kind: PoolKind) -> None:
        """Check the new tokens against the history and positions, then record them."""
        rec, off = self.records[pool_kind], batch.token_offset
        ids, pos, loc = batch.input_ids.cpu(), batch.positions.cpu(), batch.out_cache_loc.cpu()
        start = 0
        for i in range(batch.real_batch_size):
            pre, ext, hist = batch.prefix_lens_host[i], batch.extend_lens_host[i], batch.histories[i]
            for t in range(ext):
                p, tok = int(pos[start + t]), int(ids[start + t])
                if p != pre + t or (p + off < len(hist) and hist[p + off] != tok):
                    self._flag(batch.req_ids[i])
            start += ext
        rec[loc, 0], rec[loc, 1] = ids, pos

    def on_free(self, slots: torch.Tensor) -> None:
        """Freed slots hold nothing."""
        for rec in self.records.values():
            rec[slots.cpu()] = -1


class _Tee(NullHooks):
    """Hooks that call the oracle, then the canary."""

    def __init__(self, first: EngineHooks, second: EngineHooks) -> None:
        self.first, self.second = first, second

    def before_forward(self, batch: ForwardBatch, pool_kind: PoolKind) -> None:
        """Both, in order."""
        self.first.before_forward(batch, pool_kind)
        self.second.before_forward(batch, pool_kind)

    def after_forward(self, batch: ForwardBatch, pool_kind: PoolKind) -> None:
        """Both, in order."""
        self.first.after_forward(batch, pool_kind)
        self.second.after_forward(batch, pool_kind)

    def on_alloc(self, slots: torch.Tensor) -> None:
        """Both, in order."""
        self.first.on_alloc(slots)
        self.second.on_alloc(slots)

    def on_free(self, slots: torch.Tensor) -> None:
        """Both, in order."""
        self.first.on_free(slots)
        self.second.on_free(slots)


class _Watch:
    """Observer after every bracket: notes when the fault fired and disarms a perturbation after its first event."""

    def __init__(self, case: FaultCase) -> None:
        self.case = case
        self.fire_forwards: list[int] = []  # forwards at whose start the engine fault had fired (again)
        self._fired = 0
        self.victims: set[int] = set()  # req_to_token rows a perturbation targeted
        self.requests: set[str] = set()  # requests the bookkeeping oracle saw damaged (engine faults)
        self.chain: int | None = None

    def __call__(self, canary: EngineCanary, batch: ForwardBatch, kind: PoolKind) -> None:
        case = self.case
        if case.engine_fault is not None:
            fired = canary.engine.faults.fired[case.engine_fault]
            if fired > self._fired:  # faults fire only in host code, never inside a forward
                self._fired = fired
                self.fire_forwards.append(canary.forwards)
        elif case.perturb is not None and not self.fire_forwards:
            events = canary.target.perturber.events
            if events:
                self.fire_forwards.append(canary.forwards)
                detail = events[0].detail
                self.victims = {int(detail[k]) for k in ("row", "victim_row", "row_a", "row_b") if k in detail}
                if "token_index_a" in detail:
                    self.victims |= _token_rows(batch, detail["token_index_a"], detail["token_index_b"])
                self.chain = detail.get("chain")
                canary.target.perturber.config = PerturbConfig()  # one event per trial

    def fire_forward(self, damaged_at: int) -> int:
        """The forward the (effective) fault took effect in: the last firing at or before the first damage seen."""
        if not damaged_at:
            return self.fire_forwards[0] if self.fire_forwards else 0
        return max((f for f in self.fire_forwards if f <= damaged_at), default=damaged_at)


def _token_rows(batch: ForwardBatch, *token_indices: int) -> set[int]:
    rows, off = set(), 0
    for row, ext in zip(batch.req_pool_indices_host, batch.extend_lens_host, strict=True):
        if any(off <= k < off + ext for k in token_indices):
            rows.add(row)
        off += ext
    return rows


def _matches(case: FaultCase, v: Violation) -> bool:
    return v.tag.stage in case.stages and bool(int(v.reasons) & int(case.reasons))


def run_trial(case: FaultCase, seed: int, device: str = "cpu", backend: str = "torch", policy: str = "campaign",
              **canary_changes: Any) -> TrialResult:
    """Run ``case`` once with ``seed`` (workload, fault and perturbation draws) and judge the canary's report;
    ``policy`` picks the base configuration (:data:`POLICIES`: the campaign's or ``CanaryConfig()``'s defaults) and
    ``canary_changes`` override its knobs (e.g. token_truth=OFF to show what truth buys)."""
    t0 = time.perf_counter()
    rng = random.Random(seed)
    probs: dict[str, Any] = {case.engine_fault: 1.0} if case.engine_fault else {}
    faults = replace(FaultConfig(seed=seed), **probs) if case.engine_fault else None
    engine = build_engine(case.engine, case.spec, device, faults)
    perturb = PerturbConfig({case.perturb: 1.0}, warmup_steps=3, seed=seed) if case.perturb else PerturbConfig()
    watch = _Watch(case)
    config = POLICIES[policy](backend, perturb=perturb, **canary_changes)
    canary = EngineCanary(engine, config, on_forward=watch)
    oracle = BookkeepingOracle(engine)
    engine.hooks = _Tee(oracle, canary)
    WORKLOADS[case.workload](engine, rng)
    canary.flush()
    fire = watch.fire_forward(oracle.first_forward if case.engine_fault else 0)
    bound = sweep_bound(config, engine.config.num_slots) if case.detect == _SWEEP else case.bound
    res = TrialResult(case.name, seed, fired=fire > 0, detected=False, false_positive=False,
                      forwards=canary.forwards, fire_forward=fire, bound=bound)
    res.seconds = time.perf_counter() - t0
    victims = set(engine.faults.kv_victims) or oracle.victims  # real-KV faults name their victims themselves
    if res.fired and case.engine_fault is not None and not victims:
        res.fired, res.no_effect = False, True
    watch.requests = victims - {IDLE_VICTIM}
    if not res.fired:
        res.false_positive = canary.total > 0
        return res
    first_fire = watch.fire_forwards[0]
    res.false_positive = any(d.forward < first_fire for d in canary.detections)
    after = [d for d in canary.detections if d.forward >= first_fire]
    if not after:
        return res
    first = after[0]
    res.detected, res.pool, res.detect_forward = True, first.pool.value, first.forward
    if first.report.violations:
        v0 = first.report.violations[0]
        res.first_check = f"{v0.tag.name} {'+'.join(reason_names(int(v0.reasons)))}"
    # the expected check, attributed correctly, in the first report that has it
    hit = next(((d, v) for d in after for v in d.report.violations
                if _matches(case, v) and _attributed(case, watch, v)), None)
    if hit is None:
        return res
    d, v = hit
    res.tag, res.reasons = v.tag.name, reason_names(int(v.reasons))
    res.request = None if v.request_id is None else str(v.request_id)
    res.stage_ok = res.reason_ok = res.request_ok = True
    res.forwards_to_detect = _latency(canary, case, d.pool, v.request_id, fire, d.forward)
    res.within_bound = 0 <= res.forwards_to_detect <= bound
    return res


def _attributed(case: FaultCase, watch: _Watch, v: Violation) -> bool:
    if v.tag.stage == Stage.SWEEP:  # a sweep row names the cached chain (no request holds it)
        return watch.chain is None or (v.chain.index if v.chain is not None else v.batch_index) == watch.chain
    if case.on_padding:
        return v.request_id is None
    if v.request_id is None:
        return False
    if case.expect_request is not None and v.request_id != case.expect_request:
        return False
    if watch.requests:
        return v.request_id in watch.requests
    return not watch.victims or v.req_row in watch.victims


def _latency(canary: EngineCanary, case: FaultCase, pool: PoolKind, request: Hashable | None, fire: int,
             detect: int) -> int:
    """Forwards of ``pool`` after the fault took effect until the report (0: the same forward); per-forward
    checks count only the forwards that include the attributed request."""
    n = 0
    for i in range(fire, detect + 1):  # forward i is log index i - 1; empty when a check beat the oracle
        if canary.log.pools[i - 1] != pool:
            continue
        if case.detect == _PER_FORWARD and request is not None and request not in canary.log.requests[i - 1]:
            continue
        n += 1
    return max(0, n - 1)


# ---------------------------------------------------------------------------------------------- summaries

@dataclass
class CaseSummary:
    """Trials of one case, aggregated."""

    case: FaultCase
    trials: list[TrialResult]

    @property
    def detected(self) -> int:
        """Trials where the canary reported the fault with the expected check, attribution and latency."""
        return sum(r.ok for r in self.trials)

    @property
    def fired(self) -> int:
        """Trials where the fault actually fired."""
        return sum(r.fired for r in self.trials)

    def row(self) -> dict[str, Any]:
        """One line of the detection table."""
        fired = [r for r in self.trials if r.fired]
        first = next((r for r in fired if r.detected), fired[0] if fired else None)
        lat = [r.forwards_to_detect for r in fired if r.detected]
        return {"fault": self.case.name, "bug_class": self.case.bug_class, "needs": self.case.needs,
                "check": self.case.detect, "trials": len(self.trials), "fired": len(fired),
                "detected": self.detected, "false_positives": sum(r.false_positive for r in self.trials),
                "tag": first.tag if first else "", "reasons": "+".join(first.reasons) if first else "",
                "request": first.request if first else None,
                "forwards_to_detect_max": max(lat) if lat else None,
                "bound": max((r.bound for r in self.trials), default=self.case.bound),
                "ok": bool(fired) and self.detected == len(fired) and len(fired) == len(self.trials)}


def run_campaign(cases: Sequence[FaultCase], seeds: Sequence[int], device: str = "cpu", backend: str = "torch",
                 progress: Callable[[int, int, str], None] | None = None,
                 policy: str = "campaign") -> list[CaseSummary]:
    """Every case under every seed; ``progress(done, total, label)`` after each trial."""
    total, done, out = len(cases) * len(seeds), 0, []
    for case in cases:
        trials = []
        for seed in seeds:
            trials.append(run_trial(case, seed, device, backend, policy))
            done += 1
            if progress is not None:
                progress(done, total, case.name)
        out.append(CaseSummary(case, trials))
    return out


# ---------------------------------------------------------------------------------------------- clean runs

@dataclass
class CleanResult:
    """A clean (fault-free) run: forwards, violations, time, what the canary checked."""

    forwards: int
    target_forwards: int
    draft_forwards: int
    violations: int
    input_errors: int
    seconds: float
    entries_checked: int = 0
    entries_written: int = 0
    sweeps: int = 0
    sweep_slices: int = 0
    prefix_hit_tokens: int = 0
    retractions: int = 0
    evicted_slots: int = 0
    chunks: int = 0
    coverage: float = 0.0
    first_violations: list[str] = field(default_factory=list)
    # watchdog and plan-status problems (skipped requests, overflow, missed launches): logged, never violations
    health_problems: list[str] = field(default_factory=list)


def clean_engine_config(rng: random.Random, spec: bool) -> dict[str, Any]:
    """A random engine geometry of the soak: page size, chunking, padding, pool pressure (eviction, retraction)."""
    cfg: dict[str, Any] = {"page_size": rng.choice([1, 1, 2, 4]), "chunk_size": rng.choice([4, 8, 16, 32, 64]),
                           "num_slots": rng.choice([256, 384, 512, 1024]), "max_running": rng.choice([2, 4, 8]),
                           "max_reqs": 16, "max_context": 256}
    if spec:
        cfg["spec_num_draft"] = rng.choice([1, 2, 3, 4])
    else:
        cfg["decode_pad_multiple"] = rng.choice([1, 1, 2, 4])
        cfg["mixed_batching"] = rng.random() < 0.3
    cfg["num_swa_slots"] = swa_slots_needed(cfg, rng.uniform(1.0, 1.5))
    return cfg


def swa_slots_needed(cfg: dict[str, Any], factor: float = 1.0) -> int:
    """SWA slots for every running request's window plus a chunk (the engine raises when the SWA pool runs dry)."""
    per_req = TARGET_MODEL.sliding_window + cfg.get("chunk_size", 64) + cfg.get("spec_num_draft", 0) + \
        2 * cfg.get("page_size", 1)
    return int(factor * cfg.get("max_running", 8) * per_req) + 8


def run_clean(seed: int, num_requests: int, device: str = "cpu", backend: str = "torch", spec: bool | None = None,
              canary: bool = True, engine_overrides: dict[str, Any] | None = None,
              config: CanaryConfig | None = None) -> CleanResult:
    """A random fault-free workload (prefix reuse, eviction, chunked prefill, SWA, retract/resume, draft offset)."""
    rng = random.Random(seed)
    spec = rng.random() < 0.4 if spec is None else spec
    cfg = clean_engine_config(rng, spec)
    cfg.update(engine_overrides or {})
    engine = build_engine((), spec, device, **cfg)
    can = EngineCanary(engine, config or canary_config(backend)) if canary else None
    t0 = time.perf_counter()
    mixed_workload(engine, rng, num_requests)
    if can is not None:
        can.flush()
    secs = time.perf_counter() - t0
    st = engine.stats
    res = CleanResult(st.forwards + st.draft_forwards, st.forwards, st.draft_forwards, 0, 0, secs,
                      prefix_hit_tokens=st.prefix_hit_tokens, retractions=st.retractions,
                      evicted_slots=st.evicted_slots, chunks=st.chunks)
    if can is None:
        return res
    res.violations = can.total
    res.first_violations = [v.line() for v in can.violations()[:5]]
    ms = [m for m in can.managers.values() if m.enabled]
    res.input_errors = int(sum(m.metrics.counters["input_errors"] for m in ms))
    res.entries_checked = int(sum(m.metrics.counters["entries_checked"] for m in ms))
    res.entries_written = int(sum(m.metrics.counters["entries_written"] for m in ms))
    res.sweeps = sum(m.sweeps_completed for m in ms)
    res.sweep_slices = sum(m.sweeper.slices for m in ms)
    res.coverage = can.target.metrics.gauges["coverage"]
    res.health_problems = [p.message for m in ms for p in m.health.problems]
    return res


def set_cpu_threads() -> None:
    """One intra-op thread: the tiny engine's ops are far too small to share, and oversubscription costs 10-20x."""
    torch.set_num_threads(1)
