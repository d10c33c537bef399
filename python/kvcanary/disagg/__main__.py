"""Launcher: python -m kvcanary.disagg [--device cpu|cuda] [--requests N] [--fault NAME] [--json]."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .engines import Workload
from .launcher import LaunchConfig, launch
from .transport import FaultName, FaultSpec


def parse_args(argv: list[str] | None = None) -> tuple[LaunchConfig, bool, str | None]:
    """Command line -> (LaunchConfig, print JSON, output file)."""
    p = argparse.ArgumentParser(prog="python -m kvcanary.disagg", description=__doc__)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--fault", choices=[f.value for f in FaultName], default="none")
    p.add_argument("--target", type=int, default=1, help="0-based transfer index the fault hits")
    p.add_argument("--fault-seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=1, help="truncate_layers: trailing layers that never arrive")
    p.add_argument("--model", choices=("full", "swa"), default="full")
    p.add_argument("--prompt-len", default="12:40", help="MIN[:MAX] prompt length")
    p.add_argument("--max-new-tokens", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--backend", choices=("auto", "torch", "cpu", "cuda"), default="auto")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds any transfer step may wait for the peer")
    p.add_argument("--no-canary", action="store_true")
    p.add_argument("--no-reference", action="store_true")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--out", help="also write the JSON result to this file")
    a = p.parse_args(argv)
    lo, _, hi = a.prompt_len.partition(":")
    return LaunchConfig(device=a.device, model=a.model,
                        workload=Workload(a.requests, int(lo), int(hi or lo), a.max_new_tokens, a.seed),
                        fault=FaultSpec(FaultName(a.fault), a.target, a.fault_seed, a.layers),
                        canary=not a.no_canary, backend=a.backend, timeout_s=a.timeout,
                        reference=not a.no_reference, page_size=a.page_size), bool(a.json), a.out


def main(argv: list[str] | None = None) -> int:
    """Run and print; exit status 0 when the run behaved as the fault predicts."""
    cfg, as_json, out = parse_args(argv)
    result = launch(cfg)
    text = json.dumps(result, indent=2, default=str)
    if out:
        Path(out).write_text(text + "\n")
    if as_json:
        print(text)
    else:
        ov = result["overhead"]
        print(f"disagg {cfg.device} model={cfg.model} requests={cfg.workload.count} fault={result['fault']}")
        print(f"  ok={result['ok']} failed={result['failed']}")
        print(f"  detected={result['detected']} prefill_violations={result['prefill_violations']}")
        print(f"  outputs_match_reference={result['outputs_match_reference']} errors={result['errors']}")
        print(f"  transfer: kv={ov['kv_bytes']} B canary={ov['canary_bytes']} B ({ov['canary_pct_of_kv']}% of KV)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
