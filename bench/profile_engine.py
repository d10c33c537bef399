"""Where the reference engine's canary time goes: cProfile of the demo's clean run, restricted to the canary's hooks
(callees of the hooks, callers of the torch calls they make). Usage: python -m bench.profile_engine [--device cuda]
[--steps 100] [--out FILE]."""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
from pathlib import Path

from kvcanary.demo import clean_run

HOOKS = (r"(engine/canary.py:\d+\((before|after)_forward|on_free)|manager.py:\d+\((begin_forward|end_forward|_roll|"
         r"_export|invalidate)|sweep.py:\d+\((roll|_derive)|upload.py:\d+\((upload|stage)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    prof = cProfile.Profile()
    prof.enable()
    res = clean_run(0, a.device, a.backend if a.backend != "auto" else a.device, a.steps, quiet=True)
    prof.disable()
    text = io.StringIO()
    for p in res["phases"]:
        text.write(f"{p['phase']}: {p['forwards']} forwards, canary {p['canary_ms_per_forward']} ms per forward\n")
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumulative").print_stats(HOOKS)
    stats.print_callees(HOOKS)
    stats.sort_stats("tottime").print_callers(r"\{(built-in method torch|method '(copy_|to|cpu|item|tolist)')")
    Path(a.out).write_text(text.getvalue()) if a.out else print(text.getvalue())


if __name__ == "__main__":
    main()
