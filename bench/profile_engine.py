"""Where the reference engine's canary time goes: cProfile of the demo's clean run, restricted to the canary's hooks
(callees of the hooks, callers of the torch calls they make); on CUDA also every host sync (torch's sync debug mode)
by the line that caused it. Usage: python -m bench.profile_engine [--device cuda] [--steps 100] [--drain] [--out FILE].

``--drain`` synchronizes the device before each canary hook (outside the hook's own timer): the hooks then find the
GPU idle and the launch queue empty, so their time is the canary's host work alone, without waiting for the engine's
queued kernels (a launch into a full queue, a pageable copy in the engine's export)."""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import warnings
from pathlib import Path

import torch
from kvcanary.demo import clean_run
from kvcanary.engine.canary import EngineCanary

HOOKS = (r"(engine/canary.py:\d+\((before|after)_forward|on_free|_export)|"
         r"manager.py:\d+\((begin_forward|end_forward|_roll|_export|invalidate)|sweep.py:\d+\((roll|_derive)|upload.py:\d+\((upload|stage)|program.py:\d+\(_bind")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--drain", action="store_true", help="synchronize the device before each canary hook")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if a.drain:
        _drain_before_hooks()
    prof = cProfile.Profile()
    cuda = a.device == "cuda"
    with warnings.catch_warnings(record=True) as syncs:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        prof.enable()
        res = clean_run(0, a.device, a.backend if a.backend != "auto" else a.device, a.steps, quiet=True)
        prof.disable()
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    text = io.StringIO()
    where = collections.Counter(f"{w.filename}:{w.lineno}" for w in syncs if "synchroniz" in str(w.message))
    text.write(f"host syncs by line ({sum(where.values())}):\n" + "".join(f"  {n:6d} {k}\n" for k, n in
                                                                         where.most_common(30)))
    for p in res["phases"]:
        drained = " (drained: syncs added)" if a.drain else ""
        text.write(f"{p['phase']}: {p['forwards']} forwards, canary {p['canary_ms_per_forward']} ms per forward "
                   f"(export {p['export_ms_per_forward']} ms), engine {p['ms_per_forward_plain']} ms per forward "
                   f"without the canary, {p['ms_per_forward_canary']} with{drained}\n")
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumulative").print_stats(HOOKS)
    stats.print_callees(HOOKS)
    stats.sort_stats("tottime").print_callers(r"\{(built-in method torch|method '(copy_|to|cpu|item|tolist)')")
    Path(a.out).write_text(text.getvalue()) if a.out else print(text.getvalue())


def _drain_before_hooks() -> None:
    """Every EngineCanary hook first waits for the device (the wait is outside the hook's timer)."""
    for name in ("before_forward", "after_forward", "on_free"):
        hook = getattr(EngineCanary, name)

        def drained(self: EngineCanary, *args: object, _hook: object = hook) -> None:
            if self.engine.device.type == "cuda":
                torch.cuda.synchronize(self.engine.device)
            _hook(self, *args)  # type: ignore[operator]
        setattr(EngineCanary, name, drained)


if __name__ == "__main__":
    main()
