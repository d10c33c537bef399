"""Pools bench_transformers runs (their JSON files) into one verdict per config: every run's step pairs taken together,
their median, 95 % interval and verdict, the pairs against the control likewise, and the attributed bound's quartiles
over every run's decode steps. A pair is a ratio within one round of one run, so runs on different hosts pool their
pairs, not their step times; one call resolves about +-0.8 points on the H200 hosts, several calls pooled resolve
less. Usage: python -m bench.pool_tf_runs FILE... [--out FILE]"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from bench.bench_transformers import RAW_KEYS, _combined, _median_ci, _quartiles, _verdict


class PoolError(ValueError):
    """The runs cannot be pooled: a file without per-step lists (written before they were kept), or configs whose
    targets disagree."""


def pool(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per config of any run (file name -> its JSON) with step pairs: the pooled row."""
    rows: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for name, run in runs.items():
        for r in run["rows"]:
            if "overhead_pct" in r:  # a config paired with the baseline
                rows.setdefault(r["config"], []).append((name, r))
    return [_pooled(config, of) for config, of in rows.items()]


def _pooled(config: str, of: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """One config's rows of several runs (file name, row) as one row."""
    for name, r in of:
        if "pairs_pct" not in r:
            raise PoolError(f"{name}: {config!r} has no per-step pairs (a run from before bench_transformers kept "
                            f"{RAW_KEYS}); run it again")
    pairs = sorted(p for _, r in of for p in r["pairs_pct"])
    out: dict[str, Any] = {"config": config, "runs": len(of), "step_pairs": len(pairs),
                           "overhead_pct": round(statistics.median(pairs), 2),
                           "overhead_ci95_pct": [round(x, 2) for x in _median_ci(pairs)],
                           "run_overheads_pct": [r["overhead_pct"] for _, r in of]}
    targets = {r.get("target_pct") for _, r in of}
    if len(targets) != 1:
        raise PoolError(f"{config!r}: the runs name different targets {sorted(map(str, targets))}")
    target = targets.pop()
    if target is None:  # the control and the spin: their pairs only
        return out
    met_pairs = _verdict(pairs, target)
    att = sorted(a for _, r in of for a in r.get("attributed_pct", []))
    # the bound counts only where every run profiled its steps as host-bound (bench_transformers' met_attributed)
    host_bound = bool(att) and all(r.get("met_attributed") is not None for _, r in of)
    met_att = _quartiles(att)[1] <= target if host_bound else None
    out.update({"target_pct": target, "met_pairs": met_pairs, "met_attributed": met_att,
                "met": _combined(met_pairs, met_att)})
    if att:
        out.update({"attributed_overhead_pct": round(statistics.median(att), 3),
                    "attributed_upper_quartile_pct": round(_quartiles(att)[1], 3)})
    vs = sorted(p for _, r in of for p in r.get("pairs_vs_control_pct", []))
    if vs:
        out.update({"overhead_vs_control_pct": round(statistics.median(vs), 2),
                    "overhead_vs_control_ci95_pct": [round(x, 2) for x in _median_ci(vs)],
                    "met_vs_control": _verdict(vs, target), "vs_control_pairs": len(vs)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    runs = {f: json.loads(Path(f).read_text()) for f in a.files}
    rows = pool(runs)
    for r in rows:
        print(json.dumps(r))
    if a.out:
        Path(a.out).write_text(json.dumps({"files": a.files, "commands": [r.get("command") for r in runs.values()],
                                           "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
