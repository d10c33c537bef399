"""Host cost of binding the device program: the reference engine's target canary after the demo's first forwards, its
program bound again with four stage variants (pre/post, with and without the reuse check), once per install at the
static buffers' full size (every batch shape then runs on it). Prints µs per bind, best of the repeats, and the bound
shapes the forwards ran at. Usage: python -m bench.bench_binds [--device cpu] [--forwards 30] [--repeats 25]
[--out FILE]."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import kvcanary.demo as demo
from kvcanary.engine.canary import EngineCanary

VARIANTS = (("pre", False), ("pre", True), ("post", False), ("post", True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--forwards", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    _, spec, geometry, n = demo._CLEAN[0]
    engine = demo.C.build_engine((), spec, args.device, None, **geometry)
    canary = EngineCanary(engine, demo.C.POLICIES["default"](args.device))
    m = canary.target
    prog, shapes = m.program, set()
    bound_shape = prog.bound_shape

    def noted(bs: int, nt: int) -> tuple[int, int]:
        shapes.add(got := bound_shape(bs, nt))
        return got
    prog.bound_shape = noted  # type: ignore[method-assign]
    demo.C.mixed_workload(engine, demo._rng(0), n, max_forwards=args.forwards)
    table = m._slot_table()

    def bind_all() -> None:
        stages = prog._bind(table)
        for v in VARIANTS:
            stages[v]
    bind_all()
    best = min(_timed(bind_all) for _ in range(args.repeats))
    row = {"device": args.device, "shapes_run": len(shapes), "variants": len(VARIANTS),
           "us_per_bind": round(best * 1e6, 1)}
    print(json.dumps(row))
    if args.out:
        args.out.write_text(json.dumps(row) + "\n")


def _timed(fn: Callable[[], None]) -> float:
    """Seconds per call of ``fn`` over 10 calls."""
    t0 = time.perf_counter()
    for _ in range(10):
        fn()
    return (time.perf_counter() - t0) / 10


if __name__ == "__main__":
    main()
