"""Summary of gpu/run_rounds_ab.sh: per bench_runtime row and side, the median and the best over the rounds."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

# (mode, field) pairs summarized per batch size: the rows (means) and their medians
FIELDS = {"eager": ("total_mean_us", "total_us", "begin_us", "pre_us", "post_us", "end_us"),
          "replay": ("total_mean_us", "total_us", "begin_us", "end_us", "window_forwards_mean_us",
                     "other_forwards_mean_us")}

ENGINE_FIELDS = ("canary_ms_per_forward", "warm_canary_ms_per_forward", "export_ms_per_forward",
                 "warm_export_ms_per_forward")


def summarize(folder: Path) -> str:
    """A markdown table: one line per (mode, bs, field), A and B as 'median (best) over n rounds'."""
    got: dict[tuple[str, int, str, str], list[float]] = {}
    for f in sorted(folder.glob("runtime_*_*.json")):
        side = f.stem.split("_")[1]
        for r in json.loads(f.read_text())["rows"]:
            for field in FIELDS.get(r["mode"], ()):
                if r.get(field) is not None:
                    got.setdefault((r["mode"], r["bs"], field, side), []).append(r[field])
    lines = ["| mode | bs | field (us) | A: median (best) | B: median (best) | rounds |",
             "|---|---:|---|---:|---:|---:|"]
    for mode, bs, field in sorted({k[:3] for k in got}):
        cells = []
        for side in ("A", "B"):
            v = got.get((mode, bs, field, side), [])
            cells.append(f"{statistics.median(v):.1f} ({min(v):.1f})" if v else "-")
        n = len(got.get((mode, bs, field, "B"), []))
        lines.append(f"| {mode} | {bs} | {field} | {cells[0]} | {cells[1]} | {n} |")
    engine: dict[str, list[dict[str, float]]] = {}
    for f in sorted(folder.glob("engine_*.json")):
        engine.setdefault(f.stem.split("_")[1], []).extend(
            r for r in json.loads(f.read_text())["rows"] if r["mode"] == "engine")
    for side, rows in engine.items():
        cells = []
        for field in ENGINE_FIELDS:
            v = [r[field] for r in rows if r.get(field) is not None]
            cells.append(f"{field} {statistics.median(v):.3f} ({min(v):.3f})" if v else f"{field} -")
        lines.append(f"\nengine {side}, median (best) of {len(rows)}: " + ", ".join(cells))
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(Path(sys.argv[1])))
