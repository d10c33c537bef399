"""Decoding ring rows into Violation records, and the sinks: logging, JSON lines, Prometheus text, callback."""

from __future__ import annotations

import json
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch
from kvcanary_schema import NO_SLOT, CounterCol, FailReason, LaunchTag, ViolationCol

from kvcanary.errors import KVCanaryError
from kvcanary.ops.hashes import to_u64

logger = logging.getLogger("kvcanary")


def reason_names(reasons: int) -> list[str]:
    """Lower-case names of the FailReason bits set in ``reasons``."""
    return [str(r.name).lower() for r in FailReason if reasons & int(r)]


@dataclass(frozen=True)
class CachedChain:
    """The cached chain a sweep row belongs to: its index in the export, first position, length, last holders."""

    index: int
    first_position: int
    length: int
    holders: tuple[Hashable, ...] = ()


class ChainLookup(Protocol):
    """What a sweep left for its rows: the chain of a plan segment (a sweep row's BATCH_INDEX)."""

    def chain(self, segment: int) -> CachedChain | None:
        """The chain of ``segment``, None when unknown."""


@dataclass(frozen=True)
class Violation:
    """One decoded violation row, attributed to a request where the step's batch is known."""

    tag: LaunchTag
    reasons: FailReason
    slot: int
    position: int
    stored_position: int
    batch_index: int
    req_row: int
    stored_token: int
    expected_token: int
    stored_hash: int  # u64
    expected_hash: int  # u64
    stored_fp: int  # u64
    expected_fp: int  # u64
    step: int
    request_id: Hashable | None = None
    request_position: int | None = None  # position of the token in the request's sequence
    expected_slot: int = NO_SLOT  # STRUCTURAL: the slot req_to_token maps (NO_SLOT: padding, reserved slots only)
    chain: CachedChain | None = None  # sweep rows: the cached chain the slot belongs to

    def key(self) -> tuple[int, int, int]:
        """Deduplication key: the same check failing at the same slot."""
        return int(self.tag), int(self.reasons), self.slot

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (hashes as hex)."""
        return {
            "tag": self.tag.name, "reasons": reason_names(int(self.reasons)), "slot": self.slot,
            "position": self.position, "stored_position": self.stored_position, "batch_index": self.batch_index,
            "req_row": self.req_row, "stored_token": self.stored_token, "expected_token": self.expected_token,
            "stored_hash": f"0x{self.stored_hash:016x}", "expected_hash": f"0x{self.expected_hash:016x}",
            "stored_fp": f"0x{self.stored_fp:016x}", "expected_fp": f"0x{self.expected_fp:016x}", "step": self.step,
            "request_id": None if self.request_id is None else str(self.request_id),
            "request_position": self.request_position, "expected_slot": self.expected_slot,
            "chain": None if self.chain is None else {
                "index": self.chain.index, "first_position": self.chain.first_position, "length": self.chain.length,
                "holders": [str(h) for h in self.chain.holders]},
        }

    def line(self) -> str:
        """One key=value log line."""
        return (f"kvcanary violation: tag={self.tag.name} reasons={'+'.join(reason_names(int(self.reasons)))} "
                f"slot={self.slot} expected_slot={self.expected_slot} position={self.position} "
                f"stored_position={self.stored_position} "
                f"request={self.request_id} row={self.req_row} stored_token={self.stored_token} "
                f"expected_token={self.expected_token} stored_hash=0x{self.stored_hash:016x} "
                f"expected_hash=0x{self.expected_hash:016x} stored_fp=0x{self.stored_fp:016x} "
                f"expected_fp=0x{self.expected_fp:016x} step={self.step}{self._chain_text()}")

    def _chain_text(self) -> str:
        c = self.chain
        if c is None:
            return ""
        return (f" chain={c.index} chain_first_position={c.first_position} chain_length={c.length} "
                f"last_held_by={','.join(str(h) for h in c.holders) or '-'}")


class StepBatch(NamedTuple):
    """What the reporter needs to attribute rows of one step: request ids and rows per batch index (a named tuple:
    one is built every forward, and a frozen dataclass costs several times more to build)."""

    request_ids: Sequence[Hashable | None]
    token_offset: int = 0


def decode_rows(rows: torch.Tensor, batches: Mapping[int, StepBatch] | None = None,
                sweeps: Mapping[int, ChainLookup] | None = None) -> list[Violation]:
    """Decode ring rows (host int64 [n, NUM_VIOLATION_COLS]); attribute forward rows to requests by step, and
    sweep rows to their cached chain."""
    out: list[Violation] = []
    for r in rows.tolist():
        tag = LaunchTag(r[ViolationCol.TAG])
        step, bi = r[ViolationCol.STEP], r[ViolationCol.BATCH_INDEX]
        rid: Hashable | None = None
        rpos: int | None = None
        sweep = tag.stage.name == "SWEEP"
        lookup = sweeps.get(step) if sweeps is not None and sweep else None
        sb = batches.get(step) if batches is not None and not sweep else None
        if sb is not None and 0 <= bi < len(sb.request_ids):
            rid = sb.request_ids[bi]
            rpos = r[ViolationCol.POSITION] + sb.token_offset
        out.append(Violation(
            tag, FailReason(r[ViolationCol.REASONS]), r[ViolationCol.SLOT], r[ViolationCol.POSITION],
            r[ViolationCol.STORED_POSITION], bi, r[ViolationCol.REQ_ROW], r[ViolationCol.STORED_TOKEN],
            r[ViolationCol.EXPECTED_TOKEN], to_u64(r[ViolationCol.STORED_HASH]), to_u64(r[ViolationCol.EXPECTED_HASH]),
            to_u64(r[ViolationCol.STORED_FP]), to_u64(r[ViolationCol.EXPECTED_FP]), step, rid, rpos,
            r[ViolationCol.EXPECTED_SLOT], None if lookup is None else lookup.chain(bi)))
    return out


@dataclass
class WindowReport:
    """Everything one reporting window found: exact totals, kept rows, drops."""

    first_step: int
    last_step: int
    violations: list[Violation]
    total: int  # exact (device counters)
    ring_total: int  # rows the kernels tried to keep
    dropped: int  # rows not kept (ring full); never silent
    by_tag: dict[LaunchTag, int] = field(default_factory=dict)
    counter_delta: torch.Tensor | None = None  # host int64 [NUM_LAUNCH_TAGS, NUM_COUNTER_COLS]
    # Quarantine: table-space slots whose KV or canary record a kept row found bad. An engine must not reuse them
    # from its prefix cache (a bad block is a cache miss: evict and recompute), nor the cached tokens after them.
    quarantine: tuple[int, ...] = ()
    page_size: int = 1

    @property
    def quarantine_pages(self) -> tuple[int, ...]:
        """Pages (slot // page_size) holding a quarantined slot."""
        return tuple(sorted({s // self.page_size for s in self.quarantine}))

    @property
    def request_ids(self) -> list[Hashable]:
        """Distinct request ids of the kept rows (for aborting only affected requests)."""
        seen: dict[Hashable, None] = {}
        for v in self.violations:
            if v.request_id is not None:
                seen.setdefault(v.request_id, None)
        return list(seen)

    @property
    def input_errors(self) -> int:
        """Entries skipped for out-of-range inputs in this window."""
        return 0 if self.counter_delta is None else int(self.counter_delta[:, CounterCol.INPUT_ERRORS].sum())

    def by_reason(self) -> Counter[str]:
        """Kept rows per FailReason name."""
        c: Counter[str] = Counter()
        for v in self.violations:
            for name in reason_names(int(v.reasons)):
                c[name] += 1
        return c


class CanaryViolationError(KVCanaryError, RuntimeError):
    """Raised in RAISE mode: carries the decoded rows and the affected request ids."""

    def __init__(self, report: WindowReport) -> None:
        self.report = report
        self.violations = report.violations
        self.request_ids = report.request_ids
        head = report.violations[0].line() if report.violations else "(no row kept)"
        super().__init__(f"kvcanary: {report.total} violation(s) in steps {report.first_step}..{report.last_step} "
                         f"({report.dropped} rows dropped), requests {self.request_ids}; first: {head}")


class ReportSink(Protocol):
    """Receives every window that found something (and, for metrics, every window)."""

    def __call__(self, report: WindowReport) -> None:
        """Consume one window."""


class LogSink:
    """Logs violations: at most ``rate_limit`` lines per window, each (tag, reasons, slot) once per ``dedup`` keys."""

    def __init__(self, rate_limit: int = 20, dedup: int = 4096, log: logging.Logger | None = None) -> None:
        self.rate_limit = rate_limit
        self.log = log or logger
        self._seen: OrderedDict[tuple[int, int, int], None] = OrderedDict()
        self._dedup = dedup
        self.suppressed = 0

    def __call__(self, report: WindowReport) -> None:
        """Log the window's summary and its first new rows."""
        if report.total == 0:
            return
        printed = 0
        for v in report.violations:
            k = v.key()
            if k in self._seen:
                self._seen.move_to_end(k)
                self.suppressed += 1
                continue
            self._seen[k] = None
            if len(self._seen) > self._dedup:
                self._seen.popitem(last=False)
            if printed < self.rate_limit:
                self.log.warning(v.line())
                printed += 1
            else:
                self.suppressed += 1
        self.log.warning("kvcanary window steps %d..%d: total=%d kept=%d dropped=%d by_tag={%s} requests=%s "
                         "(suppressed so far: %d)", report.first_step, report.last_step, report.total,
                         len(report.violations), report.dropped,
                         ", ".join(f"{t.name}: {n}" for t, n in sorted(report.by_tag.items())), report.request_ids,
                         self.suppressed)


class JsonlSink:
    """Appends one JSON object per kept violation, and one per window summary, to a file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, report: WindowReport) -> None:
        """Write the window."""
        if report.total == 0:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            for v in report.violations:
                f.write(json.dumps({"type": "violation", **v.to_dict()}) + "\n")
            f.write(json.dumps({"type": "window", "first_step": report.first_step, "last_step": report.last_step,
                                "total": report.total, "kept": len(report.violations), "dropped": report.dropped,
                                "request_ids": [str(r) for r in report.request_ids]}) + "\n")


class CallbackSink:
    """Calls ``fn(report)`` for windows with violations (e.g. to abort only the affected requests)."""

    def __init__(self, fn: Callable[[WindowReport], None]) -> None:
        self.fn = fn

    def __call__(self, report: WindowReport) -> None:
        """Forward the window."""
        if report.total:
            self.fn(report)


class Metrics:
    """Cumulative counters rendered in the Prometheus text format."""

    def __init__(self) -> None:
        self.violations_by_tag: Counter[str] = Counter()
        self.rows_by_reason: Counter[str] = Counter()
        self.counters: dict[str, float] = {"forwards": 0, "dropped_rows": 0, "input_errors": 0, "sweeps_completed": 0,
                                           "health_problems": 0, "perturbations": 0, "entries_checked": 0,
                                           "entries_written": 0}
        self.gauges: dict[str, float] = {"coverage": 0.0}

    def __call__(self, report: WindowReport) -> None:
        """Account one window."""
        for tag, n in report.by_tag.items():
            self.violations_by_tag[tag.name] += n
        if report.violations:
            self.rows_by_reason.update(report.by_reason())
        self.counters["dropped_rows"] += report.dropped
        if report.counter_delta is not None:
            sums = report.counter_delta.numpy().sum(0).tolist()
            self.counters["input_errors"] += sums[CounterCol.INPUT_ERRORS]
            self.counters["entries_checked"] += sums[CounterCol.ENTRIES_CHECKED]
            self.counters["entries_written"] += sums[CounterCol.ENTRIES_WRITTEN]

    def render(self) -> str:
        """The Prometheus exposition text."""
        lines = ["# HELP kvcanary_violations_total Violations found (exact), by launch tag.",
                 "# TYPE kvcanary_violations_total counter"]
        for tag in LaunchTag:
            lines.append(f'kvcanary_violations_total{{tag="{tag.name}"}} {self.violations_by_tag[tag.name]}')
        lines += ["# HELP kvcanary_violation_rows_total Kept violation rows by fail reason.",
                  "# TYPE kvcanary_violation_rows_total counter"]
        for r in FailReason:
            name = str(r.name).lower()
            lines.append(f'kvcanary_violation_rows_total{{reason="{name}"}} {self.rows_by_reason[name]}')
        for name, value in self.counters.items():
            lines += [f"# TYPE kvcanary_{name}_total counter", f"kvcanary_{name}_total {int(value)}"]
        for name, value in self.gauges.items():
            lines += [f"# TYPE kvcanary_{name} gauge", f"kvcanary_{name} {value:.6f}"]
        return "\n".join(lines) + "\n"
