"""Command line: `kvcanary demo` (the main job), `kvcanary schema` (record layout), `kvcanary selfcheck`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def _schema_info() -> dict[str, object]:
    import kvcanary_schema as S

    return {
        "schema_version": S.SCHEMA_VERSION,
        "record_bytes": S.RECORD_BYTES,
        "record_fields": [{"name": n, "offset": o} for n, o in S.RECORD_FIELDS],
        "fail_reasons": {r.name: int(r) for r in S.FailReason},
        "launch_tags": {t.name: int(t) for t in S.LaunchTag},
        "violation_columns": [c.name for c in S.ViolationCol],
    }


def _selfcheck() -> dict[str, object]:
    """Hash the same random inputs with the torch reference and the C++ backend; report agreement."""
    import torch

    from kvcanary import _native
    from kvcanary.ops import hashes

    gen = torch.Generator().manual_seed(0)
    x = torch.randint(-(2**63), 2**63 - 1, (4096,), generator=gen, dtype=torch.int64)
    out = torch.empty_like(x)
    _native.module("cpu").hash_splitmix64(x, out)
    return {"splitmix64_vector_1": hex(hashes.splitmix64_int(1)),
            "torch_vs_cpu_backend_equal": bool(torch.equal(out, hashes.splitmix64(x))),
            "chain_h0": hex(hashes.CHAIN_H0)}


def _cmd_schema(args: argparse.Namespace) -> int:
    info = _schema_info()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"kvcanary schema v{info['schema_version']}: {info['record_bytes']}-byte record")
    for f in info["record_fields"]:  # type: ignore[attr-defined]
        print(f"  +{f['offset']:>2}  {f['name']}")
    print("fail reasons:", ", ".join(f"{k}={v}" for k, v in info["fail_reasons"].items()))  # type: ignore[attr-defined]
    print("launch tags: ", ", ".join(info["launch_tags"]))  # type: ignore[arg-type]
    return 0


def _cmd_selfcheck(args: argparse.Namespace) -> int:
    res = _selfcheck()
    print(json.dumps(res, indent=None if args.json else 2))
    return 0 if res["torch_vs_cpu_backend_equal"] else 1


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvcanary.demo import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `kvcanary` command."""
    parser = argparse.ArgumentParser(prog="kvcanary", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="reference engine + canary: clean run, then a fault campaign")
    demo.add_argument("--device", default="cpu", help="cpu or cuda")
    demo.add_argument("--backend", default="auto", help="auto, torch, cpu or cuda")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--faults", default="all", help="comma-separated fault names, or 'all' / 'none'")
    demo.add_argument("--steps", type=int, default=0, help="clean-run forwards (0 = the default workload)")
    demo.add_argument("--policy", default="default", choices=["default", "campaign"],
                      help="detection policy: CanaryConfig() defaults, or the campaign's (fingerprint all, "
                           "full sweeps)")
    demo.add_argument("--disagg", action="store_true", help="run prefill and decode as two processes")
    demo.add_argument("--json", action="store_true", help="machine-readable output")
    demo.set_defaults(func=_cmd_demo)
    schema = sub.add_parser("schema", help="print the record layout, reasons and tags")
    schema.add_argument("--json", action="store_true")
    schema.set_defaults(func=_cmd_schema)
    check = sub.add_parser("selfcheck", help="torch reference vs C++ backend on random hashes")
    check.add_argument("--json", action="store_true")
    check.set_defaults(func=_cmd_selfcheck)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `kvcanary` and `python -m kvcanary`."""
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
