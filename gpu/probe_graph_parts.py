"""Probe (GPU machine): where a small forward's graph time goes. For a few bench_gpu scenarios (fingerprint none),
times warm graph replays of every prefix of plan -> HEAD verify -> HEAD write -> TAIL verify -> TAIL write, and of
each op repeated five times (its cost per launch in a chain of its own kind). Usage: python3 gpu/probe_graph_parts.py"""

import json
import statistics
import sys

import torch
from kvcanary.ops.plan import plan_forward
from kvcanary.ops.verify import verify
from kvcanary.ops.write import write
from kvcanary_schema import Stage

from bench.bench_gpu import CHECKS, Scenario, State, events_us


def ops(st: State) -> dict[str, object]:
    n = int(st.ids.numel())
    return {
        "plan": lambda: plan_forward(st.plan, st.status, st.rpi, st.pre, st.ext, st.table, n, window=st.sc.window,
                                     expect_prefix=st.expect_prefix, expect_new=st.expect_new, backend="cuda"),
        "head_verify": lambda: verify(st.head, Stage.HEAD, st.plan, st.status, st.table, st.sink, backend="cuda"),
        "head_write": lambda: write(st.head, Stage.HEAD, st.plan, st.status, st.table, st.ids, st.pos, st.loc,
                                    st.sink, checks=CHECKS, workspace=st.ws[0], backend="cuda"),
        "tail_verify": lambda: verify(st.tail, Stage.TAIL, st.plan, st.status, st.table, st.sink, backend="cuda"),
        "tail_write": lambda: write(st.tail, Stage.TAIL, st.plan, st.status, st.table, st.ids, st.pos, st.loc,
                                    st.sink, checks=CHECKS, workspace=st.ws[1], backend="cuda"),
    }


def graph_us(fns: list, samples: int = 30) -> float:
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    return statistics.median(events_us(g.replay, 20) for _ in range(samples))


def main() -> None:
    names = sys.argv[1:] or ["decode bs1 pre512", "decode bs64 pre256"]
    out = {}
    for name in names:
        # e.g. "decode bs1 pre512", "swa bs128 pre10240 K+V", "extend bs1 pre0 ext4096"
        kind, bs, pre, *rest = name.split()
        ext = next((int(r[3:]) for r in rest if r.startswith("ext")), 1)
        swa = kind == "swa"
        sc = Scenario(name, int(bs[2:]), int(pre[3:]), ext, halves=2 if "K+V" in rest else 1, swa=swa,
                      window=128 if swa else 0, seal=False)
        st = State(sc)
        o = ops(st)
        seq = list(o.values())
        row = {}
        for k in range(1, len(seq) + 1):
            row["prefix " + "+".join(list(o)[:k])] = graph_us(seq[:k])
        for key, f in o.items():
            row[f"{key} x5"] = graph_us([o["plan"]] + [f] * 5) - graph_us([o["plan"]])
        row["plan x5"] = graph_us([o["plan"]] * 5)
        out[name] = {k: round(v, 2) for k, v in row.items()}
        print(name, json.dumps(out[name], indent=1), flush=True)


if __name__ == "__main__":
    main()
