"""Host cost of binding a batch shape's device program: the reference engine's target canary after the demo's first
forwards, every shape it bound bound again with four stage variants (pre/post, with and without the reuse check).
Prints µs per shape, best of the repeats. Usage: python -m bench.bench_binds [--device cpu] [--forwards 30]
[--repeats 25] [--fresh-verifies] [--out FILE]. ``--fresh-verifies``: the verifies (shared by every shape of a plan-row
count in a run) are bound again for each shape too."""

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
    ap.add_argument("--fresh-verifies", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    _, spec, geometry, n = demo._CLEAN[0]
    engine = demo.C.build_engine((), spec, args.device, None, **geometry)
    canary = EngineCanary(engine, demo.C.POLICIES["default"](args.device))
    demo.C.mixed_workload(engine, demo._rng(0), n, max_forwards=args.forwards)
    m = canary.target
    prog, table, shapes = m.program, m._slot_table(), list(m.program._cache)

    def bind_all() -> None:
        for shape in shapes:
            if args.fresh_verifies:
                prog._verify_ops.clear()
            stages = prog._bind(shape, table)
            for v in VARIANTS:
                stages[v]
    bind_all()
    best = min(_timed(bind_all) for _ in range(args.repeats)) / len(shapes)
    row = {"device": args.device, "shapes": len(shapes), "variants": len(VARIANTS),
           "fresh_verifies": args.fresh_verifies, "us_per_shape": round(best * 1e6, 1)}
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
