"""Launcher: python -m kvcanary.disagg [--device cpu|cuda] [--requests N] [--fault NAME|all] [--json]."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from .campaign import CAMPAIGN_IDLE_S, CAMPAIGN_STARTUP_S, CAMPAIGN_TIMEOUT_S, error_line, format_row, judge
from .engines import MODELS, Workload
from .launcher import LaunchConfig, launch
from .transport import FaultName, FaultSpec


def parse_args(argv: list[str] | None = None) -> tuple[list[LaunchConfig], argparse.Namespace]:
    """Command line -> one LaunchConfig per requested model, and the raw options."""
    p = argparse.ArgumentParser(prog="python -m kvcanary.disagg", description=__doc__)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--fault", choices=[*(f.value for f in FaultName), "all"], default="none",
                   help="'all': a campaign over every fault (per model)")
    p.add_argument("--target", type=int, default=1, help="0-based transfer index the fault hits")
    p.add_argument("--fault-seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=1, help="truncate_layers: trailing layers that never arrive")
    p.add_argument("--model", nargs="+", choices=sorted(MODELS), default=["full"],
                   help="model preset(s); several run one after the other")
    p.add_argument("--prompt-len", default="12:40", help="MIN[:MAX] prompt length")
    p.add_argument("--max-new-tokens", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--backend", choices=("auto", "torch", "cpu", "cuda"), default="auto")
    p.add_argument("--timeout", type=float, default=None,
                   help=f"seconds a transfer step may wait for the peer (default 10; campaign {CAMPAIGN_TIMEOUT_S:g})")
    p.add_argument("--idle-timeout", type=float, default=None,
                   help=f"seconds to wait for the next OFFER or a GRANT (default 6 x --timeout; campaign "
                        f"{CAMPAIGN_IDLE_S:g})")
    p.add_argument("--startup", type=float, default=None,
                   help=f"seconds one launch may take besides its waits (default 120; campaign {CAMPAIGN_STARTUP_S:g})"
                        "; a launch's bound is this plus the waits its fault allows")
    p.add_argument("--start-method", choices=("spawn", "forkserver"), default=None,
                   help="forkserver: import torch once for many runs (default for a CPU campaign; else spawn)")
    p.add_argument("--bound", action="store_true", help="print the summed bound (seconds) of the runs and exit")
    p.add_argument("--token-truth", choices=("off", "chain", "pool"), default="chain")
    p.add_argument("--layer-coverage", choices=("first", "all", "sample"), default="all")
    p.add_argument("--no-canary", action="store_true")
    p.add_argument("--no-reference", action="store_true")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--out", help="also write the JSON result to this file")
    a = p.parse_args(argv)
    lo, _, hi = a.prompt_len.partition(":")
    workload = Workload(a.requests, int(lo), int(hi or lo), a.max_new_tokens, a.seed)
    campaign = a.fault == "all"
    names = [f for f in FaultName if f != FaultName.NONE] if campaign else [FaultName(a.fault)]
    timeout = a.timeout if a.timeout is not None else (CAMPAIGN_TIMEOUT_S if campaign else 10.0)
    idle = a.idle_timeout if a.idle_timeout is not None or not campaign else max(CAMPAIGN_IDLE_S, timeout)
    startup = a.startup if a.startup is not None else (CAMPAIGN_STARTUP_S if campaign else 120.0)
    start = a.start_method or ("forkserver" if campaign and a.device == "cpu" else "spawn")
    base = LaunchConfig(device=a.device, workload=workload, canary=not a.no_canary, backend=a.backend,
                        timeout_s=timeout, idle_timeout_s=idle, startup_s=startup, reference=not a.no_reference,
                        page_size=a.page_size, start_method=start, token_truth=a.token_truth,
                        layer_coverage=a.layer_coverage)
    return [dataclasses.replace(base, model=m, fault=FaultSpec(f, a.target, a.fault_seed, a.layers))
            for m in a.model for f in names], a


def _line(r: dict[str, Any]) -> str:
    ov = r["overhead"]
    return "\n".join([
        f"disagg {r['device']} model={r['model']} requests={r['requests']} fault={r['fault']}",
        f"  ok={r['ok']} failed={r['failed']}",
        f"  detected={r['detected']} prefill_violations={r['prefill_violations']}",
        f"  outputs_match_reference={r['outputs_match_reference']} errors={error_line(r)}",
        f"  transfer: kv={ov['kv_bytes']} B canary={ov['canary_bytes']} B ({ov['canary_pct_of_kv']}% of KV); "
        f"per slot {ov['bytes_per_row']}"])


def _campaign(runs: list[dict[str, Any]], result: dict[str, Any], a: argparse.Namespace) -> int:
    """Print one judged line per fault (or the same as JSON); exit 1 unless every fault passed within its bound."""
    rows = [judge(r) for r in runs]
    result.update(campaign=rows, runs=runs)
    text = json.dumps(result, indent=2, default=str)
    if a.out:
        Path(a.out).write_text(text + "\n")
    if a.json:
        print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2, default=str))
    else:
        print("\n".join(format_row(row) for row in rows))
        print(f"campaign: {sum(row['outcome'] == 'pass' for row in rows)}/{len(rows)} pass, "
              f"{result['wall_s']:.1f} s (bound {result['bound_s']:g} s)")
    return 0 if all(row["outcome"] == "pass" for row in rows) else 1


def main(argv: list[str] | None = None) -> int:
    """Run each model and print (text or JSON); exit 1 when a role crashed, hung or was not predicted to fail."""
    cfgs, a = parse_args(argv)
    bound = sum(cfg.bound_s for cfg in cfgs)
    if a.bound:
        print(f"{bound:g}")
        return 0
    t0 = time.monotonic()
    runs = [launch(cfg) for cfg in cfgs]
    command = " ".join(["python -m kvcanary.disagg", *(sys.argv[1:] if argv is None else argv)])
    if a.fault == "all":
        return _campaign(runs, {"command": command, "wall_s": round(time.monotonic() - t0, 2), "bound_s": bound}, a)
    result: dict[str, Any] = runs[0] if len(runs) == 1 else {"runs": runs}
    result["command"] = command
    text = json.dumps(result, indent=2, default=str)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(text if a.json else "\n".join(_line(r) for r in runs))
    expected_death = {FaultName.KILL_DECODE, FaultName.KILL_PREFILL}
    typed = {"PeerLostError", "TransferTimeoutError", "TransferProtocolError", "TransferError"}
    bad = [r for r in runs if "hung" in r["exitcodes"].values() or
           any(e is not None and e["type"] not in typed for e in r["errors"].values()) or
           (FaultName(r["fault"]) not in expected_death and set(r["exitcodes"].values()) != {0})]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
