"""Eager forwards of a few bench_gpu scenarios, for Nsight Compute (each kernel profiled alone): where the small
launches of the issue-13 rows spend their time (python -m bench.ncu_targets [scenario names...]; under
ncu --profile-from-start off)."""

from __future__ import annotations

import sys

import torch

from bench.bench_gpu import State, scenarios


def main() -> None:
    wanted = sys.argv[1:] or ["decode bs1 pre512 ext1 K perm", "extend bs1 pre0 ext4096 K perm"]
    for sc in scenarios(True):
        if any(w == sc.name for w in wanted):
            st = State(sc)
            st.forward("cuda")  # warm: module load, first launches
            torch.cuda.synchronize()
            torch.cuda.profiler.start()  # ncu --profile-from-start off: only these forwards
            for _ in range(2):
                st.forward("cuda")
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            print("profiled", sc.name, flush=True)


if __name__ == "__main__":
    main()
