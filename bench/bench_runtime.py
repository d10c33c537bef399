"""Runtime benchmark: eager host overhead of one forward bracket (decode bs 1/64/256), allocations and syncs."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from kvcanary.adapter import BatchView, GroupSpec, PoolDescription
from kvcanary.config import CanaryConfig
from kvcanary.manager import CanaryManager, install
from kvcanary.ops.types import SourceSpec
from kvcanary_schema import Group
from torch.utils._python_dispatch import TorchDispatchMode

_SYNC = ("_local_scalar_dense", "item", "nonzero", "_to_copy")
_VIEWS = {"slice", "select", "view", "as_strided", "alias", "narrow", "expand", "unsqueeze", "squeeze", "t",
          "transpose", "permute", "detach", "_reshape_alias", "reshape"}


class _OpCounter(TorchDispatchMode):
    """Counts aten ops that allocate (not in place, not out=, not a view) and ops that sync with the host."""

    def __init__(self) -> None:
        super().__init__()
        self.allocating = 0
        self.syncs = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        parts = name.split(".")
        base = parts[1] if len(parts) > 1 else name
        if not (base.endswith("_") or parts[-1] == "out" or base in _VIEWS):
            self.allocating += 1
        if any(s in name for s in _SYNC):
            self.syncs += 1
        return func(*args, **(kwargs or {}))


class Workload:
    """``bs`` requests with ``prefix`` cached tokens each (slots placed by a random permutation), decoding."""

    def __init__(self, bs: int, prefix: int, steps: int, device: torch.device, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.bs, self.device = bs, device
        self.ctx = prefix + steps + 2
        self.num_slots = bs * self.ctx + 1
        perm = torch.randperm(self.num_slots - 1, generator=g) + 1
        self.table = perm.view(bs, self.ctx).to(torch.int32)
        self.req_to_token = torch.zeros(bs + 1, self.ctx, dtype=torch.int32)
        self.req_to_token[1:] = self.table
        self.req_to_token = self.req_to_token.to(device)
        self.history = [torch.randint(0, 32000, (self.ctx,), generator=g).tolist() for _ in range(bs)]
        self.lens = [0] * bs
        self.ids = [f"req{i}" for i in range(bs)]
        # real KV of 4 layers, K only, one 256-byte row per slot: the default fingerprint policy hashes it
        self.kv = [torch.randn(self.num_slots, 2, 64, generator=g).to(torch.bfloat16).to(device) for _ in range(4)]

    def pool(self) -> PoolDescription:
        group = GroupSpec(Group.FULL, self.num_slots, 1, reserved_slots=1, sources=[[SourceSpec(t) for t in self.kv]])
        return PoolDescription(self.num_slots, self.bs + 1, self.ctx, [group], self.device, padding_row=0)

    def batch(self, extend: int) -> BatchView:
        rows = list(range(1, self.bs + 1))
        pres = list(self.lens)
        exts = [extend] * self.bs
        ids = [t for i in range(self.bs) for t in self.history[i][pres[i]:pres[i] + extend]]
        pos = [p for i in range(self.bs) for p in range(pres[i], pres[i] + extend)]
        loc = [int(self.table[i, p]) for i in range(self.bs) for p in range(pres[i], pres[i] + extend)]
        d = self.device

        def t(v: list[int]) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.int64, device=d)
        for i in range(self.bs):
            self.lens[i] += extend
        return BatchView(t(rows), t(pres), t(exts), self.req_to_token, t(ids), t(pos), t(loc), self.ids, rows, pres,
                         exts, self.history)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_case(bs: int, prefix: int, backend: str, device: torch.device, iters: int) -> dict[str, Any]:
    """Median host time per bracket phase over ``iters`` decode forwards, plus allocation/sync counts."""
    w = Workload(bs, prefix, iters + 2, device)
    cfg = CanaryConfig(backend=backend, stats_interval=0, sweep_interval=0, req_capacity=max(bs, 1),
                       token_capacity=max(bs * prefix, bs), ring_capacity=1024)
    m: CanaryManager = install(w.pool(), cfg)
    cuda = device.type == "cuda"
    mem = [0, 0]

    def bracket(b: BatchView, timed: dict[str, list[float]] | None, counter: _OpCounter | None) -> None:
        t0 = time.perf_counter()
        m.begin_forward(b)
        t1 = time.perf_counter()
        if counter is not None:
            _sync(device)
            mem[0] = torch.cuda.memory_stats(device).get("allocation.all.allocated", 0) if cuda else 0
            with counter:
                m.pre_forward()
                m.post_forward()
            mem[1] = torch.cuda.memory_stats(device).get("allocation.all.allocated", 0) if cuda else 0
        else:
            m.pre_forward()
            t2 = time.perf_counter()
            m.post_forward()
        t3 = time.perf_counter()
        m.end_forward()
        t4 = time.perf_counter()
        if timed is not None:
            timed["begin"].append(t1 - t0)
            timed["pre"].append(t2 - t1)
            timed["post"].append(t3 - t2)
            timed["end"].append(t4 - t3)
            timed["total"].append(t4 - t0)
    bracket(w.batch(prefix), None, None)  # prefill
    bracket(w.batch(1), None, None)  # warm-up
    counter = _OpCounter()
    bracket(w.batch(1), None, counter)
    timed: dict[str, list[float]] = {k: [] for k in ("begin", "pre", "post", "end", "total")}
    for _ in range(iters):
        b = w.batch(1)
        _sync(device)
        bracket(b, timed, None)
    _sync(device)
    rep = m.flush()
    violations = sum(r.total for r in m.reports)
    return {"bs": bs, "prefix": prefix, "backend": backend, "device": str(device),
            **{f"{k}_us": round(statistics.median(v) * 1e6, 1) for k, v in timed.items()},
            "device_allocating_ops_per_forward": counter.allocating, "host_syncs_per_forward": counter.syncs,
            "cuda_allocations_in_device_parts": mem[1] - mem[0] if cuda else None,
            "violations": violations, "last_window_total": None if rep is None else rep.total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backends", default="torch,cpu")
    ap.add_argument("--bs", default="1,64,256")
    ap.add_argument("--prefix", type=int, default=128)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    device = torch.device(a.device)
    rows = []
    for backend in a.backends.split(","):
        for bs in map(int, a.bs.split(",")):
            r = bench_case(bs, a.prefix, backend, device, a.iters)
            rows.append(r)
            print(json.dumps(r))
    out = {"machine": platform.node(), "torch": torch.__version__, "cpu_count": torch.get_num_threads(),
           "command": f"python -m bench.bench_runtime --device {a.device} --backends {a.backends} --bs {a.bs} "
                      f"--prefix {a.prefix} --iters {a.iters}",
           "note": "eager host time of one decode bracket (begin/pre/post/end), median; K half, FULL group, "
                   "token truth chain, policy full; device parts include the op work on CPU",
           "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
