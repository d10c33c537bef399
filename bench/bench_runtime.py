"""Runtime benchmark: host time of the forward bracket (eager; CUDA also graph replay) per phase, against the issue's
targets (#13), plus allocations and syncs of the device parts and the reference engine's canary time per forward."""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import platform
import pstats
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from kvcanary.adapter import BatchView, GroupSpec, PoolDescription
from kvcanary.config import CanaryConfig
from kvcanary.manager import CanaryManager, install
from kvcanary.ops.types import SourceSpec
from kvcanary_schema import Group
from torch.utils._python_dispatch import TorchDispatchMode

# --profile: the profiler switched on around the host parts (begin_forward, end_forward) of the timed forwards
PROFILER: cProfile.Profile | None = None


def _host(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, profiled when --profile is on."""
    if PROFILER is None:
        return fn(*args, **kwargs)
    PROFILER.enable()
    try:
        return fn(*args, **kwargs)
    finally:
        PROFILER.disable()


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

    def rewind(self, tokens: int) -> None:
        """Forget the last ``tokens`` decoded tokens of every request (a batch that was built but never ran)."""
        self.lens = [n - tokens for n in self.lens]

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
        # host facts as arrays and the new tokens' truth as a tensor: the bulk (fast) form of the batch view
        host = np.asarray([rows, pres, exts], dtype=np.int64)
        return BatchView(t(rows), t(pres), t(exts), self.req_to_token, t(ids), t(pos), t(loc), self.ids, host[0],
                         host[1], host[2], self.history, true_new_tokens=torch.tensor(ids, dtype=torch.int64))


@contextlib.contextmanager
def _gc_off() -> Iterator[None]:
    """The timed iterations with Python's cyclic garbage collector off, as timeit does: a collection would land on
    whichever bracket crosses the threshold and charge it with the benchmark's own garbage (the batches it builds).
    The canary's own objects are freed by reference counting either way."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _mean_us(seconds: list[float]) -> float | None:
    return round(statistics.fmean(seconds) * 1e6, 1) if seconds else None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# The host targets (#13, on an H100): eager bracket per batch size, replayed graphs, reference engine.
EAGER_TARGET_US = {1: 60.0, 64: 80.0, 256: 100.0}
REPLAY_TARGET_US = 30.0
ENGINE_TARGET_MS = 0.15


def make_config(name: str, backend: str, bs: int, prefix: int, req_capacity: int = 0) -> CanaryConfig:
    """``default``: CanaryConfig()'s detection policy; ``minimal``: the policy before #14 (no fingerprints, seal,
    reuse check, rolling sweep or structural check); ``per-forward``: the default policy staging a report window
    every forward (report_interval 1, the default before the violation alarm). Capacities fit the workload
    (``req_capacity`` > 0: that many requests, as an engine installs for its largest batch)."""
    caps = {"backend": backend, "req_capacity": req_capacity or max(bs, 1), "token_capacity": max(bs * prefix, bs)}
    if name == "per-forward":
        return CanaryConfig(report_interval=1, **caps)  # type: ignore[arg-type]
    if name == "minimal":
        return CanaryConfig(fingerprint="none", layer_coverage="first", seal=False, reuse_check=False, sweep_slice=0,
                            structural_check=False, stats_interval=0, **caps)  # type: ignore[arg-type]
    return CanaryConfig(**caps)  # type: ignore[arg-type]


def bench_case(bs: int, prefix: int, backend: str, device: torch.device, iters: int,
               config: str = "default", req_capacity: int = 0) -> dict[str, Any]:
    """Median host time per bracket phase over ``iters`` decode forwards, plus allocation/sync counts."""
    w = Workload(bs, prefix, iters + 2, device)
    m: CanaryManager = install(w.pool(), make_config(config, backend, bs, prefix, req_capacity))
    cuda = device.type == "cuda"
    mem = [0, 0]

    def bracket(b: BatchView, timed: dict[str, list[float]] | None, counter: _OpCounter | None) -> None:
        t0 = time.perf_counter()
        _host(m.begin_forward, b) if timed is not None else m.begin_forward(b)
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
        _host(m.end_forward) if timed is not None else m.end_forward()
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
    with _gc_off():
        for _ in range(iters):
            b = w.batch(1)
            _sync(device)
            bracket(b, timed, None)
    _sync(device)
    rep = m.flush()
    violations = sum(r.total for r in m.reports)
    return {"mode": "eager", "config": config, "bs": bs, "prefix": prefix, "backend": backend, "device": str(device),
            **{f"{k}_us": round(statistics.median(v) * 1e6, 1) for k, v in timed.items()},
            "total_mean_us": round(statistics.fmean(timed["total"]) * 1e6, 1),
            "device_allocating_ops_per_forward": counter.allocating, "host_syncs_per_forward": counter.syncs,
            "cuda_allocations_in_device_parts": mem[1] - mem[0] if cuda else None,
            "violations": violations, "last_window_total": None if rep is None else rep.total}


def warmed(bs: int, prefix: int, steps: int, device: torch.device,
           config: CanaryConfig) -> tuple[Workload, CanaryManager]:
    """A workload of ``steps`` decodes and a manager installed with ``config`` that has run its prefill and one decode,
    eager."""
    w = Workload(bs, prefix, steps, device)
    m = install(w.pool(), config)
    for b in (w.batch(prefix), w.batch(1)):
        m.begin_forward(b)
        m.pre_forward()
        m.post_forward()
        m.end_forward()
    return w, m


def bench_replay(bs: int, prefix: int, backend: str, device: torch.device, iters: int,
                 config: str = "default", req_capacity: int = 0) -> dict[str, Any]:
    """CUDA: pre/post captured in graphs once, then the median host time of begin(kind=replay) + end per decode, and
    the GPU time of the two replayed graphs (events around them: the canary's device work of one captured forward)."""
    w, m = warmed(bs, prefix, iters + 4, device, make_config(config, backend, bs, prefix, req_capacity))
    pre_g, post_g, side = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    cap = w.batch(1)
    m.begin_forward(cap, kind="capture")
    with torch.cuda.stream(side):
        with torch.cuda.graph(pre_g, stream=side):
            m.pre_forward()
        with torch.cuda.graph(post_g, stream=side):
            m.post_forward()
    torch.cuda.current_stream(device).wait_stream(side)
    m.end_forward()
    w.rewind(1)  # the capture batch never ran: decode its tokens again
    begin, end, events, window = [], [], [], []
    with _gc_off():
        for _ in range(iters):
            b = w.batch(1)
            _sync(device)
            marks = (m.reporter.stagings, len(m.reports))
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))  # type: ignore[no-untyped-call]
            t0 = time.perf_counter()
            _host(m.begin_forward, b, kind="replay")
            t1 = time.perf_counter()
            ev[0].record()
            pre_g.replay()
            post_g.replay()
            ev[1].record()
            t2 = time.perf_counter()
            _host(m.end_forward)
            t3 = time.perf_counter()
            begin.append(t1 - t0)
            end.append(t3 - t2)
            events.append(ev)
            window.append(marks != (m.reporter.stagings, len(m.reports)))  # a window staged or collected in it
    _sync(device)
    m.flush()
    med = statistics.median
    gpu_us = med(a.elapsed_time(b) * 1e3 for a, b in events)
    total = [a + b for a, b in zip(begin, end, strict=True)]
    return {"mode": "replay", "config": config, "bs": bs, "prefix": prefix, "backend": backend,
            "device": str(device), "begin_us": round(med(begin) * 1e6, 1), "end_us": round(med(end) * 1e6, 1),
            "total_us": round(med(total) * 1e6, 1),
            "total_mean_us": round(statistics.fmean(total) * 1e6, 1),
            "total_p90_us": round(statistics.quantiles(total, n=10)[-1] * 1e6, 1),
            # the mean's parts: forwards that staged or collected a reporting window, and the others
            "window_forwards": sum(window),
            "window_forwards_mean_us": _mean_us([t for t, w in zip(total, window, strict=True) if w]),
            "other_forwards_mean_us": _mean_us([t for t, w in zip(total, window, strict=True) if not w]),
            # where the tail is: the slowest forwards without a window, as (iteration, begin us, end us)
            "slowest_other_forwards": [(i, round(begin[i] * 1e6, 1), round(end[i] * 1e6, 1)) for i in sorted(
                (i for i in range(iters) if not window[i]), key=lambda i: -total[i])[:12]],
            "graphs_gpu_us": round(gpu_us, 1),
            "violations": sum(r.total for r in m.reports), "health_problems": len(m.health.problems)}


def engine_case(device: str, backend: str, steps: int, roll_interval: int = 0) -> dict[str, Any]:
    """The reference engine's clean run (the demo's): canary host ms per forward, worst phase. It governs the verdict
    as the demo measures it: the first run in the process, so on CUDA it includes the lazy loading of every kernel
    the canary launches for the first time. ``warm_canary_ms_per_forward``: the same run repeated in the process,
    every kernel loaded (what a server pays per forward once it has run a while, or after a warm-up).
    ``roll_interval`` > 0: the policy's ``sweep_roll_interval`` replaced (1: a rolling-sweep slice every forward)."""
    from kvcanary.demo import clean_run
    changes = {"sweep_roll_interval": roll_interval} if roll_interval else {}

    def worst(res: dict[str, Any]) -> dict[str, Any]:
        return max(res["phases"], key=lambda p: p["canary_ms_per_forward"])

    cold_run = clean_run(0, device, backend, steps, quiet=True, **changes)
    cold, warm = worst(cold_run), worst(clean_run(0, device, backend, steps, quiet=True, **changes))
    return {"mode": "engine", "device": device, "backend": backend, "steps": steps, "roll_interval": roll_interval,
            "canary_ms_per_forward": cold["canary_ms_per_forward"], "phase": cold["phase"],
            "export_ms_per_forward": cold.get("export_ms_per_forward"),
            "warm_canary_ms_per_forward": warm["canary_ms_per_forward"], "warm_phase": warm["phase"],
            "warm_export_ms_per_forward": warm.get("export_ms_per_forward"), "violations": cold_run["violations"]}


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """One line per host row of the issue: measured, target, met/missed (CPU numbers are proxies)."""
    out = []
    for r in rows:
        if r["mode"] == "engine":
            got, want, unit = r["canary_ms_per_forward"], ENGINE_TARGET_MS, "ms"
            what = f"reference engine canary/fw (warm {r['warm_canary_ms_per_forward']:.2f})"
        elif r["mode"] == "replay":  # the mean: a reporting window's cost lands on one forward in report_interval
            got, want, unit = r["total_mean_us"], REPLAY_TARGET_US, "us"
            what = f"replay begin+end bs {r['bs']} ({r['config']}; median {r['total_us']:.0f}, forwards with a " \
                f"window {r['window_forwards_mean_us'] or 0:.0f}, others {r['other_forwards_mean_us'] or 0:.0f})"
        elif r["bs"] in EAGER_TARGET_US:
            got, want, unit = r["total_mean_us"], EAGER_TARGET_US[r["bs"]], "us"
            what = f"eager bracket bs {r['bs']} ({r['config']})"
        else:
            continue
        tag = "met" if got <= want else "MISSED"
        out.append(f"{what:<40} {got:>9.1f} {unit}  target <= {want:g} {unit}  {tag}  [{r['device']}/{r['backend']}]")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backends", default="torch,cpu")
    ap.add_argument("--bs", default="1,64,256")
    ap.add_argument("--prefix", type=int, default=128)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--config", default="default", help="default (CanaryConfig()), minimal (before #14), per-forward "
                    "(the defaults staging a report window every forward), both (default + minimal) or all")
    ap.add_argument("--engine-steps", type=int, default=200, help="reference engine forwards (0: skip that row)")
    ap.add_argument("--req-capacity", type=int, default=0, help="requests the canary is installed for (0: the batch "
                    "size; an engine installs for its largest batch)")
    ap.add_argument("--roll-interval", type=int, default=0, help="the reference engine row's sweep_roll_interval "
                    "(0: the policy's; 1: a rolling-sweep slice every forward)")
    ap.add_argument("--out", default="")
    ap.add_argument("--profile", default="", help="write a cProfile summary of begin_forward and end_forward over "
                    "every timed forward, eager and replayed, to this file (the timings then include the profiler's "
                    "own cost; the reference engine: python -m bench.profile_engine)")
    a = ap.parse_args()
    global PROFILER
    PROFILER = cProfile.Profile() if a.profile else None
    device = torch.device(a.device)
    configs = {"both": ["default", "minimal"], "all": ["default", "minimal", "per-forward"]}.get(a.config, [a.config])
    rows = []
    for config in configs:
        for backend in a.backends.split(","):
            for bs in map(int, a.bs.split(",")):
                rows.append(bench_case(bs, a.prefix, backend, device, a.iters, config, a.req_capacity))
                print(json.dumps(rows[-1]))
                if device.type == "cuda":
                    rows.append(bench_replay(bs, a.prefix, backend, device, a.iters, config, a.req_capacity))
                    print(json.dumps(rows[-1]))
    if a.engine_steps:
        rows.append(engine_case(a.device, a.backends.split(",")[-1], a.engine_steps, a.roll_interval))
        print(json.dumps(rows[-1]))
    lines = verdicts(rows)
    print("\n".join(["", "host targets (#13, mean per forward; measured on an H100 they govern, elsewhere proxies):",
                      *lines]))
    out = {"machine": platform.node(), "torch": torch.__version__, "cpu_count": torch.get_num_threads(),
           "command": f"python -m bench.bench_runtime --device {a.device} --backends {a.backends} --bs {a.bs} "
                      f"--prefix {a.prefix} --iters {a.iters} --config {a.config} --engine-steps {a.engine_steps} "
                      f"--req-capacity {a.req_capacity} --roll-interval {a.roll_interval}",
           "note": "host time of one decode bracket (begin/pre/post/end; replay: begin+end around graph replays), "
                   "median; K half, FULL group, token truth chain (bulk form: true_new_tokens), policy full; on CPU "
                   "the device parts include the op work itself; Python's cyclic GC off during the timed iterations "
                   "(as timeit)",
           "rows": rows, "verdicts": lines}
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    if PROFILER is not None:
        text = io.StringIO()
        for key in ("tottime", "cumulative"):
            pstats.Stats(PROFILER, stream=text).sort_stats(key).print_stats(60)
        Path(a.profile).write_text(f"{out['command']} --profile\n{text.getvalue()}")


if __name__ == "__main__":
    main()
