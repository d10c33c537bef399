"""Probe: host µs of a clean reporting window (the staging in ``Reporter.stage`` and the report in
``Reporter.collect``), over a seeded decode workload at bs 1, each call timed around itself; on CUDA a collect that
finds no arrived snapshot is not counted. A window's cost lands on one forward in ``report_interval``.
Usage: python3 gpu/probe_window_cost.py [forwards, default 6400] [device, default cpu]."""

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.bench_runtime import _gc_off, make_config, warmed


def timed(times: list[float], fn: Callable[..., Any], counted: Callable[[Any], bool]) -> Callable[..., Any]:
    """``fn`` with its host time appended to ``times`` when ``counted(result)``."""
    def call(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        if counted(out):
            times.append(time.perf_counter() - t0)
        return out
    return call


def main() -> None:
    forwards = int(sys.argv[1]) if len(sys.argv) > 1 else 6400
    dev = torch.device(sys.argv[2] if len(sys.argv) > 2 else "cpu")
    w, m = warmed(1, 128, forwards + 8, dev, make_config("default", dev.type, 1, 128, 0))
    stage: list[float] = []
    collect: list[float] = []
    rep = m.reporter
    rep.stage = timed(stage, rep.stage, lambda _: True)  # type: ignore[method-assign]
    rep.collect = timed(collect, rep.collect, lambda out: out is not None)  # type: ignore[method-assign]
    with _gc_off():
        for _ in range(forwards):
            m.begin_forward(w.batch(1))
            m.pre_forward()
            m.post_forward()
            m.end_forward()
    m.flush()
    if m.reporter.violations_total:
        raise SystemExit(f"the workload is not clean: {m.reporter.violations_total} violations")
    med = statistics.median
    print(f"{dev.type}: {len(stage)} windows of {m.config.report_interval} forwards ")
    print(f"  stage    median {med(stage) * 1e6:7.1f} us")
    print(f"  collect  median {med(collect) * 1e6:7.1f} us  ({len(collect)} reports)")
    print(f"  per forward {(med(stage) + med(collect)) * 1e6 / m.config.report_interval:.2f} us")


if __name__ == "__main__":
    main()
