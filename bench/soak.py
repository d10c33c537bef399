"""Soak (python -m bench.soak): >= 100k clean forwards with zero violations and >= 1000 seeded fault trials.

``--policy default`` (the default) runs ``CanaryConfig()``'s detection policy; ``--policy campaign`` the campaign's
(fingerprint all over every layer, a full sweep every 4 forwards).

Work is cut into chunks (one clean workload per seed, one fault trial per case and seed) that run in worker
processes and are appended to a checkpoint file (build/soak/<out>.chunks.jsonl) as they finish, so an interrupted
soak resumes where it stopped (``--resume``). ``--quick`` is a smoke run of the same code.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import sys
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
CHECKPOINTS = RESULTS.parents[1] / "build" / "soak"  # git-ignored: finished chunks, for --resume


def _init_worker() -> None:
    import logging

    import torch
    torch.set_num_threads(1)
    logging.getLogger("kvcanary").setLevel(logging.ERROR)


def _clean_chunk(args: tuple[int, int, str, str, str]) -> dict[str, Any]:
    from kvcanary import campaign as C
    seed, requests, device, backend, policy = args
    try:
        res = C.run_clean(seed, requests, device, backend, config=C.POLICIES[policy](backend))
    except Exception as exc:  # an engine error is a finding of the soak, not a reason to stop it
        return {"kind": "clean", "key": f"clean:{seed}", "seed": seed, "error": repr(exc),
                **asdict(C.CleanResult(0, 0, 0, 0, 0, 0.0))}
    return {"kind": "clean", "key": f"clean:{seed}", "seed": seed, "error": None, **asdict(res)}


def _fault_chunk(args: tuple[str, int, str, str, str]) -> dict[str, Any]:
    from kvcanary import campaign as C
    name, seed, device, backend, policy = args
    trial = C.run_trial(C.CASES_BY_NAME[name], seed, device, backend, policy)
    return {"kind": "fault", "key": f"fault:{name}:{seed}", **trial.to_dict()}


def _load(path: Path) -> dict[str, dict[str, Any]]:
    done: dict[str, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                done[rec["key"]] = rec
    return done


def summarize(records: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """The soak's result: clean totals and, per fault case, effective trials, detections and latency."""
    from kvcanary import campaign as C
    clean = [r for r in records if r["kind"] == "clean"]
    faults = [r for r in records if r["kind"] == "fault"]
    c_sum: dict[str, Any] = {k: sum(r[k] for r in clean) for k in (
        "forwards", "target_forwards", "draft_forwards", "violations", "input_errors", "entries_checked",
        "entries_written", "sweeps", "prefix_hit_tokens", "retractions", "evicted_slots", "chunks")}
    c_sum["sweep_slices"] = sum(r.get("sweep_slices", 0) for r in clean)
    c_sum["workloads"] = len(clean)
    c_sum["workloads_with_draft"] = sum(r["draft_forwards"] > 0 for r in clean)
    c_sum["seconds"] = round(sum(r["seconds"] for r in clean), 1)
    c_sum["first_violations"] = [line for r in clean for line in r["first_violations"]][:10]
    c_sum["engine_errors"] = [f"seed {r['seed']}: {r['error']}" for r in clean if r.get("error")]
    by_case: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in faults:
        by_case[r["case"]].append(r)
    rows = []
    for case in C.CASES:
        rs = by_case.get(case.name, [])
        eff = [r for r in rs if r["fired"]]
        ok = [r for r in eff if r["ok"]]
        lat = [r["forwards_to_detect"] for r in ok]
        tags = sorted({r["tag"] for r in ok})
        rows.append({"fault": case.name, "bug_class": case.bug_class, "needs": case.needs, "check": case.detect,
                     "runs": len(rs), "no_effect": sum(r["no_effect"] for r in rs), "trials": len(eff),
                     "detected": len(ok), "false_positives": sum(r["false_positive"] for r in rs),
                     "forwards_to_detect_max": max(lat) if lat else None,
                     "forwards_to_detect_mean": round(sum(lat) / len(lat), 3) if lat else None,
                     "bound": max((r.get("bound", case.bound) for r in rs), default=case.bound), "tags": tags,
                     "misses": [f"seed {r['seed']}: {r['first_check'] or 'nothing'}" for r in eff if not r["ok"]][:5]})
    trials = sum(r["trials"] for r in rows)
    detected = sum(r["detected"] for r in rows)
    return {**meta, "clean": c_sum, "faults": rows, "fault_trials": trials, "fault_detected": detected,
            "fault_false_positives": sum(r["false_positives"] for r in rows),
            "ok": c_sum["violations"] == 0 and c_sum["input_errors"] == 0 and trials == detected
            and not c_sum["engine_errors"]}


def markdown(s: dict[str, Any]) -> str:
    """The summary as a Markdown report."""
    c = s["clean"]
    lines = [f"# kvcanary soak ({s['device']}, backend {s['backend']}, policy {s.get('policy', 'campaign')})", "",
             f"Command: `{s['command']}`  ", f"Machine: {s['machine']}; workers {s['workers']}; wall "
             f"{s['wall_seconds']:.0f} s; finished {s['finished']}" + ("" if s["complete"] else " (INCOMPLETE)"), "",
             "## Clean soak (randomized workloads: prefix reuse, eviction, chunked prefill, SWA windows, "
             "retract/resume, padding, mixed batches, speculative decoding with the +1 draft pool)", "",
             f"- forwards: **{c['forwards']}** ({c['target_forwards']} target + {c['draft_forwards']} draft) over "
             f"{c['workloads']} workloads ({c['workloads_with_draft']} speculative)",
             f"- rate: {60 * c['forwards'] / max(s['wall_seconds'], 1e-9):.0f} clean forwards per minute of wall time "
             f"({s['workers']} workers; fault trials share the wall time when run)",
             f"- violations: **{c['violations']}**, input errors: {c['input_errors']}, engine errors: "
             f"{len(c['engine_errors'])}",
             f"- records checked {c['entries_checked']}, written {c['entries_written']}, sweeps {c['sweeps']} full + "
             f"{c.get('sweep_slices', 0)} rolling slices",
             f"- prefix-hit tokens {c['prefix_hit_tokens']}, retractions {c['retractions']}, evicted slots "
             f"{c['evicted_slots']}, prefill chunks {c['chunks']}", "",
             "## Fault trials", "",
             f"**{s['fault_detected']} / {s['fault_trials']}** effective trials detected by the expected check, "
             f"attributed correctly, within the bound; false positives before the fault: "
             f"{s['fault_false_positives']}.", "",
             "| fault | bug class | needs | check | trials | detected | no effect | max fwd (bound) | mean fwd "
             "| tags |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in s["faults"]:
        lines.append(f"| {r['fault']} | {r['bug_class']} | {r['needs']} | {r['check']} | {r['trials']} | "
                     f"{r['detected']} | {r['no_effect']} | {r['forwards_to_detect_max']} ({r['bound']}) | "
                     f"{r['forwards_to_detect_mean']} | {', '.join(r['tags'])} |")
    lines += ["", "fwd: forwards until the report (0 = the forward in which the fault took effect; per-forward checks "
              "count the damaged request's forwards in that pool, the sweep the pool's forwards). A trial whose fault "
              "fired without damaging anything (e.g. a predicted token equal to the true one) is 'no effect'.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run (or resume) the soak and write <out>.json and <out>.md."""
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__)
    p.add_argument("--forwards", type=int, default=100_000, help="clean forwards to reach")
    p.add_argument("--trials", type=int, default=1000, help="fault trials (spread over every case)")
    p.add_argument("--requests", type=int, default=32, help="requests per clean workload (one chunk)")
    p.add_argument("--workers", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy", default="default", choices=["default", "campaign"],
                   help="detection policy: CanaryConfig() defaults, or the campaign's (fingerprint all, full sweeps)")
    p.add_argument("--out", default="", help="output path without extension (default: bench/results/soak_cpu for "
                   "the campaign policy, soak_default_cpu for the default one)")
    p.add_argument("--resume", action="store_true", help="keep the chunks of an earlier run with the same --out")
    p.add_argument("--deadline", type=float, default=0.0, help="stop scheduling after this many seconds (0 = none)")
    p.add_argument("--quick", action="store_true", help="smoke run: 2000 forwards, 2 trials per case")
    p.add_argument("--summarize-only", action="store_true", help="rewrite <out>.json/.md from the checkpoint")
    a = p.parse_args(argv)
    from kvcanary import campaign as C
    if a.quick:
        a.forwards, a.trials = 2000, 2 * len(C.CASES)
    out = Path(a.out or RESULTS / ("soak_cpu" if a.policy == "campaign" else "soak_default_cpu"))
    ckpt = CHECKPOINTS / f"{out.name}.chunks.jsonl"
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    if not a.resume and not a.summarize_only and ckpt.exists():
        ckpt.unlink()
    done = _load(ckpt)
    if a.summarize_only:
        old = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").exists() else {}
        meta = {k: old[k] for k in ("command", "device", "backend", "policy", "workers", "machine", "wall_seconds",
                                    "finished",
                                    "complete", "target_forwards", "target_trials") if k in old}
        summary = summarize(list(done.values()), meta)
        out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
        out.with_suffix(".md").write_text(markdown(summary))
        return 0 if summary["ok"] else 1
    t0 = time.time()
    per_case = math.ceil(a.trials / len(C.CASES))
    fault_tasks = [(c.name, a.seed + i, a.device, a.backend, a.policy) for i in range(per_case) for c in C.CASES]
    fault_tasks = [t for t in fault_tasks if f"fault:{t[0]}:{t[1]}" not in done]
    forwards = sum(r["forwards"] for r in done.values() if r["kind"] == "clean")
    next_seed = 1 + max([r["seed"] for r in done.values() if r["kind"] == "clean"], default=a.seed * 100_000)
    ctx = mp.get_context("spawn")
    stop = False
    with ctx.Pool(a.workers, initializer=_init_worker) as pool, ckpt.open("a") as f:
        def record(rec: dict[str, Any]) -> None:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            done[rec["key"]] = rec

        for i, rec in enumerate(pool.imap_unordered(_fault_chunk, fault_tasks)):
            record(rec)
            if i % 50 == 0:
                print(f"fault trials {i + 1}/{len(fault_tasks)} ({time.time() - t0:.0f}s)", file=sys.stderr, flush=True)
            if a.deadline and time.time() - t0 > a.deadline:
                stop = True  # leaving the pool terminates the workers; --resume picks up the rest
                break
        pending = 0
        results = []
        while forwards < a.forwards and not stop:
            while pending < 2 * a.workers:
                results.append(pool.apply_async(_clean_chunk, ((next_seed, a.requests, a.device, a.backend,
                                                                 a.policy),)))
                next_seed += 1
                pending += 1
            res = results.pop(0).get()
            pending -= 1
            record(res)
            forwards += res["forwards"]
            print(f"clean forwards {forwards}/{a.forwards} violations "
                  f"{sum(r['violations'] for r in done.values() if r['kind'] == 'clean')} "
                  f"({time.time() - t0:.0f}s)", file=sys.stderr, flush=True)
            stop = bool(a.deadline) and time.time() - t0 > a.deadline
        for r in results:
            rec = r.get()
            record(rec)
            forwards += rec["forwards"]
    prev = json.loads(out.with_suffix(".json").read_text()) if a.resume and out.with_suffix(".json").exists() else {}
    command = "python -m bench.soak " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = {"command": f"{prev['command']}; then {command}" if prev else command,
            "device": a.device, "backend": a.backend, "policy": a.policy, "workers": a.workers,
            "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.python_implementation()} "
                       f"{platform.python_version()}",
            "wall_seconds": round(time.time() - t0 + prev.get("wall_seconds", 0.0), 1),
            "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "complete": forwards >= a.forwards and not stop, "target_forwards": a.forwards, "target_trials": a.trials}
    summary = summarize(list(done.values()), meta)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(summary))
    print(markdown(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
