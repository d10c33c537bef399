"""cProfile of the eager forward bracket (bench_runtime's decode workload): where the host time of each phase goes."""

from __future__ import annotations

import argparse
import cProfile
import pstats

import torch
from kvcanary import install
from kvcanary.adapter import BatchView

from bench.bench_runtime import Workload, make_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--config", default="default")
    ap.add_argument("--forwards", type=int, default=1000)
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    device = torch.device(a.device)
    w = Workload(a.bs, 128, a.forwards + 2, device)
    m = install(w.pool(), make_config(a.config, a.backend, a.bs, 128))

    def bracket(b: BatchView) -> None:
        m.begin_forward(b)
        m.pre_forward()
        m.post_forward()
        m.end_forward()
    bracket(w.batch(128))
    bracket(w.batch(1))
    batches = [w.batch(1) for _ in range(a.forwards)]  # built outside the profile
    prof = cProfile.Profile()
    prof.enable()
    for b in batches:
        bracket(b)
    prof.disable()
    m.flush()
    pstats.Stats(prof).sort_stats("tottime").print_stats(a.top)


if __name__ == "__main__":
    main()
