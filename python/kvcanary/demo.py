"""`kvcanary demo`: the reference engine with kvcanary in LOG mode — a clean run, then a fault campaign."""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import torch
from kvcanary_schema import CounterCol, LaunchTag

from kvcanary import _native
from kvcanary import campaign as C
from kvcanary.engine import ForwardBatch, PoolKind
from kvcanary.engine.canary import EngineCanary
from kvcanary.errors import KVCanaryError

# The clean run: (label, spec, engine geometry, requests). Prefix reuse, chunked prefill, SWA windows, padding,
# mixed batches, eviction and retraction (a small pool) in the first; the EAGLE-style draft pool in the second.
_CLEAN: tuple[tuple[str, bool, dict[str, Any], int], ...] = (
    ("serving", False, {"page_size": 4, "chunk_size": 32, "num_slots": 512, "num_swa_slots": 768, "max_running": 8,
                        "decode_pad_multiple": 4, "mixed_batching": True}, 48),
    ("speculative", True, {"page_size": 1, "chunk_size": 16, "num_slots": 512, "num_swa_slots": 512,
                           "max_running": 6, "spec_num_draft": 3}, 24),
)


class Progress:
    """A one-line text progress bar on stderr (redrawn in place on a terminal, every 10% otherwise)."""

    def __init__(self, total: int, label: str, stream: TextIO = sys.stderr, width: int = 30) -> None:
        self.total, self.label, self.stream, self.width = max(1, total), label, stream, width
        self.tty, self.last = stream.isatty(), -1

    def update(self, done: int, note: str = "") -> None:
        """Draw ``done`` of ``total``."""
        frac = min(1.0, done / self.total)
        step = int(frac * 100) if self.tty else int(frac * 10) * 10
        if step == self.last:
            return
        self.last = step
        bar = "#" * int(frac * self.width)
        line = f"{self.label:<12} [{bar:<{self.width}}] {done}/{self.total} {note}"
        self.stream.write(("\r" + line[:110].ljust(110)) if self.tty else line + "\n")
        if self.tty and done >= self.total:
            self.stream.write("\n")
        self.stream.flush()


def _tags_active(canary: EngineCanary) -> list[str]:
    runs: set[str] = set()
    for m in canary.managers.values():
        c = m.state.sink.counters.cpu()
        for t in LaunchTag:
            if int(c[t, CounterCol.VERIFY_RUNS]) + int(c[t, CounterCol.WRITE_RUNS]) > 0:
                runs.add(t.name)
    return [t.name for t in LaunchTag if t.name in runs]


def clean_run(seed: int, device: str, backend: str, steps: int, quiet: bool, policy: str = "default",
              **changes: Any) -> dict[str, Any]:
    """The mixed workload with and without kvcanary (same seed, same forwards): violations, overhead, coverage.
    ``changes``: CanaryConfig knobs over the policy's."""
    phases, tags = [], set()
    total = sum(n for *_, n in _CLEAN)
    bar = None if quiet else Progress(total, "clean run")
    finished = 0
    for label, spec, geometry, n_requests in _CLEAN:
        budget = steps * n_requests // total if steps else 0
        timings: dict[str, float] = {}
        result: dict[str, Any] = {}
        for with_canary in (False, True):
            engine = C.build_engine((), spec, device, None, **geometry)
            canary = EngineCanary(engine, C.POLICIES[policy](backend, **changes),
                                  on_forward=_ticker(bar, finished, label)) if with_canary else None
            t0 = time.perf_counter()
            C.mixed_workload(engine, _rng(seed), n_requests, max_forwards=budget or None)
            if canary is not None:
                canary.flush()
            timings["canary" if with_canary else "plain"] = time.perf_counter() - t0
            if canary is not None:
                st = engine.stats
                ms = list(canary.managers.values())
                result = {
                    "phase": label, "requests": n_requests, "forwards": st.forwards + st.draft_forwards,
                    "target_forwards": st.forwards, "draft_forwards": st.draft_forwards,
                    "prefix_hit_tokens": st.prefix_hit_tokens, "retractions": st.retractions,
                    "evicted_slots": st.evicted_slots, "chunks": st.chunks, "spec_rounds": st.spec_rounds,
                    "violations": canary.total,
                    "input_errors": int(sum(m.metrics.counters["input_errors"] for m in ms)),
                    "records_checked": int(sum(m.metrics.counters["entries_checked"] for m in ms)),
                    "records_written": int(sum(m.metrics.counters["entries_written"] for m in ms)),
                    "sweeps": sum(m.sweeps_completed for m in ms),
                    "sweep_slices": sum(m.sweeper.slices for m in ms),
                    "coverage": round(canary.target.metrics.gauges["coverage"], 4),
                    "groups": [g.spec.group.name for g in canary.target.state.groups],
                    "seconds_in_canary": round(canary.seconds, 3),
                    "seconds_in_export": round(canary.export_seconds, 3),
                    "first_violations": [v.line() for v in canary.violations()[:3]],
                }
                tags |= set(_tags_active(canary))
        finished += n_requests
        fw = max(1, result["forwards"])
        result["seconds_plain"] = round(timings["plain"], 3)
        result["seconds_canary"] = round(timings["canary"], 3)
        result["ms_per_forward_plain"] = round(1e3 * timings["plain"] / fw, 3)
        result["ms_per_forward_canary"] = round(1e3 * timings["canary"] / fw, 3)
        result["overhead_pct"] = round(100.0 * (timings["canary"] / max(timings["plain"], 1e-9) - 1.0), 1)
        engine_s = max(timings["canary"] - result["seconds_in_canary"], 1e-9)
        result["canary_ms_per_forward"] = round(1e3 * result["seconds_in_canary"] / fw, 3)
        result["export_ms_per_forward"] = round(1e3 * result["seconds_in_export"] / fw, 3)
        result["canary_pct_of_engine"] = round(100.0 * result["seconds_in_canary"] / engine_s, 1)
        phases.append(result)
    if bar is not None:
        bar.update(total, "done")
    return {"phases": phases, "violations": sum(p["violations"] for p in phases),
            "forwards": sum(p["forwards"] for p in phases),
            "tags_active": [t.name for t in LaunchTag if t.name in tags]}


def _ticker(bar: Progress | None, base: int, label: str) -> Callable[[EngineCanary, ForwardBatch, PoolKind], None]:
    def tick(canary: EngineCanary, _: ForwardBatch, __: PoolKind) -> None:
        if bar is not None:
            e = canary.engine
            bar.update(base + len(e.scheduler.finished), f"{label}: {e.stats.forwards + e.stats.draft_forwards} "
                                                         "forwards")
    return tick


def _rng(seed: int) -> Any:
    import random
    return random.Random(seed)


def fault_campaign(names: str, seed: int, device: str, backend: str, quiet: bool, attempts: int = 4,
                   policy: str = "default") -> list[dict[str, Any]]:
    """One effective trial per fault (seeds from ``seed`` on until the fault damages something); table rows."""
    cases = C.select(names)
    bar = None if quiet or not cases else Progress(len(cases), "faults")
    rows = []
    for i, case in enumerate(cases):
        trial = C.run_trial(case, seed, device, backend, policy)
        for k in range(1, attempts):
            if trial.fired:
                break
            trial = C.run_trial(case, seed + k, device, backend, policy)
        rows.append({
            "fault": case.name, "bug_class": case.bug_class, "needs": case.needs, "check": case.detect,
            "fired": trial.fired, "detected": trial.ok, "tag": trial.tag, "reasons": "+".join(trial.reasons),
            "first_check": trial.first_check, "forwards_to_detect": trial.forwards_to_detect, "bound": trial.bound,
            "request": trial.request, "false_positive": trial.false_positive, "seed": trial.seed,
            "seconds": round(trial.seconds, 3)})
        if bar is not None:
            bar.update(i + 1, case.name)
    return rows


def _table(rows: list[dict[str, Any]], cols: list[tuple[str, str, int]]) -> str:
    head = "  ".join(f"{title:<{w}}" for _, title, w in cols)
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append("  ".join(f"{_cell(r[key]):<{w}}"[:w] for key, _, w in cols))
    return "\n".join(lines)


def _cell(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "NO"
    return "-" if v is None or v == "" else str(v)


_POLICY_TEXT = {
    "default": ("the CanaryConfig() defaults (partial fingerprint of the first layer's K per verify, the HEAD seal "
                f"over every byte, reuse check, rolling sweep of {C.default_config().sweep_slice} slots per forward "
                f"in a slice every {C.default_config().sweep_roll_interval} forwards)"),
    "campaign": (f"fingerprint ALL over every layer, a full sweep every {C.canary_config().sweep_interval} forwards"),
}


def _print_report(out: dict[str, Any], write: Callable[[str], None]) -> None:
    clean = out["clean"]
    write(f"\nkvcanary demo — reference engine on {out['device']}, backend {out['backend']}, LOG mode, "
          f"{_POLICY_TEXT[out.get('policy', 'default')]}, token truth CHAIN\n")
    write("Clean run (zero violations expected):")
    for p in clean["phases"]:
        write(f"  {p['phase']:<12} {p['requests']} requests, {p['forwards']} forwards "
              f"({p['target_forwards']} target + {p['draft_forwards']} draft), prefix hits {p['prefix_hit_tokens']} "
              f"tokens, {p['retractions']} retractions, {p['evicted_slots']} evicted slots, {p['chunks']} chunks")
        write(f"  {'':<12} violations {p['violations']}, input errors {p['input_errors']}, records checked "
              f"{p['records_checked']}, written {p['records_written']}, sweeps {p['sweeps']} full + "
              f"{p.get('sweep_slices', 0)} rolling slices, coverage "
              f"{p['coverage']:.3f}, groups {'+'.join(p['groups'])}")
        write(f"  {'':<12} overhead: {p['canary_ms_per_forward']:.2f} ms per forward inside the canary (of which "
              f"{p['export_ms_per_forward']:.2f} ms in the engine's prefix-cache export) = "
              f"{p['canary_pct_of_engine']:.0f}% of the engine's own time; wall {p['seconds_plain']:.2f}s without / "
              f"{p['seconds_canary']:.2f}s with ({p['overhead_pct']:+.0f}%, wall clock: noisy)")
        for line in p["first_violations"]:
            write(f"    {line}")
    write(f"  launch tags that ran: {len(clean['tags_active'])}/{len(LaunchTag)} ({', '.join(clean['tags_active'])})")
    write(f"  => {clean['violations']} violations over {clean['forwards']} forwards\n")
    if out["faults"]:
        write("Fault campaign (each fault injected into a running engine; detected = the expected check fired, "
              "attributed to the damaged request or cached chain, within the bound):")
        write(_table(out["faults"], [("fault", "fault", 29), ("detected", "detected", 8), ("tag", "tag", 13),
                                     ("reasons", "check", 44), ("forwards_to_detect", "fwd", 3), ("bound", "max", 3),
                                     ("request", "request", 8), ("needs", "needs", 30)]))
        write("\nfwd: forwards until reported (0 = the forward where the fault took effect; per-forward checks "
              "count the request's forwards, the sweep the pool's).")
        write("Bug classes: " + "; ".join(f"{r['fault']} = {r['bug_class']}" for r in out["faults"]
                                         if not r["fault"].startswith("perturb:")))
        found = sum(r["detected"] for r in out["faults"])
        write(f"  => {found}/{len(out['faults'])} faults detected\n")
    if "disagg" in out:
        write(f"Prefill->decode disaggregation campaign: exit code {out['disagg']['returncode']}")
    write(f"RESULT: {'PASS' if out['ok'] else 'FAIL'} ({out['seconds']:.1f}s)")


def run_demo(args: argparse.Namespace) -> int:
    """The demo job: exit 0 when the clean run has no violation and every selected fault was detected."""
    t0 = time.perf_counter()
    device = str(args.device)
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("kvcanary demo: --device cuda but no CUDA device is available", file=sys.stderr)
        return 2
    if device == "cpu":
        C.set_cpu_threads()
    logging.getLogger("kvcanary").setLevel(logging.ERROR)  # LOG mode's warnings would flood the fault campaign
    try:
        backend = _native.resolve(str(args.backend), torch.device(device).type)
    except KVCanaryError as exc:
        print(f"kvcanary demo: {exc}", file=sys.stderr)
        return 2
    quiet = bool(args.json)
    try:
        C.select(str(args.faults))
    except ValueError as exc:
        print(f"kvcanary demo: {exc}", file=sys.stderr)
        return 2
    policy = str(getattr(args, "policy", "default"))
    out: dict[str, Any] = {"device": device, "backend": backend, "seed": args.seed, "policy": policy}
    out["clean"] = clean_run(int(args.seed), device, backend, int(args.steps), quiet, policy)
    out["faults"] = fault_campaign(str(args.faults), int(args.seed), device, backend, quiet, policy=policy)
    ok = out["clean"]["violations"] == 0 and all(r["detected"] for r in out["faults"])
    if args.disagg:
        cmd = [sys.executable, "-m", "kvcanary.disagg", "--device", "cuda" if device.startswith("cuda") else "cpu",
               "--fault", "all"] + (["--json"] if quiet else [])
        proc = subprocess.run(cmd, capture_output=quiet, text=True)
        out["disagg"] = {"returncode": proc.returncode, "output": json.loads(proc.stdout) if quiet and proc.stdout
                         else None}
        ok = ok and proc.returncode == 0
    out["ok"] = ok
    out["seconds"] = round(time.perf_counter() - t0, 2)
    if args.json:
        print(json.dumps(out, indent=2, default=str))
    else:
        _print_report(out, print)
    return 0 if ok else 1
