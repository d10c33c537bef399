"""Probe: does kvcanary slow transformers' own code? transformers' parts of each decode step (prepare_next_batch,
_generation_step and inside it compute_batch and retrieve_device_outputs, update_batch), each less the canary's host
time inside it (``TransformersCanary.host_us``), for the baseline and the canary configs in alternating runs, medians
over the steady decode steps (past the 16th). Each part twice: wall time and the generation thread's CPU time
(``cpu``), so a part that waits (a sync, the GIL) shows as wall without CPU. Per run: the generation thread's CPU per
step, the main thread's CPU in the run, the Python garbage collections (gen 2: count and ms), and on CUDA the caching
allocator's device mallocs, frees and retries. Each run's line printed as it ends.
Usage: python3 gpu/probe_tf_own.py [cuda|cpu] [1b|tiny] [batch] [prompt] [new] [repeats]"""

import gc
import statistics
import sys
import time
from typing import Any

import torch
from kvcanary.program import CAPTURE_AFTER
from transformers.generation.continuous_batching.continuous_api import (
    ContinuousBatchingManager,
    ContinuousBatchProcessor,
)
from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs
from transformers.generation.continuous_batching.model_runner import ModelRunner

from bench.bench_transformers import (
    LLAMA_1B,
    LLAMA_TINY,
    VARIANTS,
    StepTimer,
    build_model,
    configs_of,
    installed,
    prompts,
    run_once,
)

PARTS = ((ContinuousBatchProcessor, "prepare_next_batch"), (ContinuousBatchProcessor, "_generation_step"),
         (ModelRunner, "compute_batch"), (ContinuousBatchingIOs, "retrieve_device_outputs"),
         (ContinuousBatchProcessor, "update_batch"))
ALLOC_KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries")
handle: list[Any] = [None]
own: dict[str, list[float]] = {}
gen2: list[float] = []  # this run's gen-2 collections, seconds each
_gc_start = [0.0]


def on_gc(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _gc_start[0] = time.perf_counter()
    elif info["generation"] == 2:
        gen2.append(time.perf_counter() - _gc_start[0])


def canary_us() -> int:
    return handle[0].host_us if handle[0] is not None else 0


def timed(cls: type, name: str) -> None:
    orig = getattr(cls, name)

    def run(self: Any, *a: Any, **k: Any) -> Any:
        c0 = canary_us()
        t, c = time.perf_counter(), time.thread_time()
        out = orig(self, *a, **k)
        dt, dc = time.perf_counter() - t, time.thread_time() - c
        canary = canary_us() - c0
        own.setdefault(name, []).append(1e6 * dt - canary)
        own.setdefault(name + " cpu", []).append(1e6 * dc - canary)
        return out
    setattr(cls, name, run)


def loop_cpu() -> None:
    """The generation thread's CPU time of each loop turn that ran a step (``own["turn cpu"]``)."""
    orig = ContinuousBatchingManager._generation_loop_body

    def body(mgr: Any, *a: Any, **k: Any) -> Any:
        before, c = mgr.current_batch, time.thread_time()
        out = orig(mgr, *a, **k)
        if mgr.current_batch != before:
            own.setdefault("turn cpu", []).append(1e6 * (time.thread_time() - c))
        return out
    ContinuousBatchingManager._generation_loop_body = body


def alloc_counts(dev: str) -> dict[str, int]:
    stats = torch.cuda.memory_stats() if dev == "cuda" else {}
    return {k: int(stats.get(k, 0)) for k in ALLOC_KEYS}


def main() -> None:
    dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    cfg = LLAMA_1B if (sys.argv[2] if len(sys.argv) > 2 else "1b") == "1b" else LLAMA_TINY
    bs, plen, new, reps = (int(x) for x in (sys.argv[3:7] if len(sys.argv) > 6 else (32, 1024, 41, 2)))
    for cls, name in PARTS:  # before install: the canary's per-instance wrapper of _generation_step calls this one
        timed(cls, name)
    loop_cpu()  # before StepTimer, which wraps whatever the class holds
    gc.callbacks.append(on_gc)
    model = build_model(cfg, dev, torch.bfloat16 if dev == "cuda" else torch.float32)
    ps = prompts(bs, plen, cfg["vocab_size"])
    configs = configs_of(VARIANTS)
    summary: dict[str, dict[str, list[float]]] = {name: {} for name, _ in configs}
    with StepTimer(dev) as timer:
        for rep in range(reps + 1):  # repeat 0 warms up
            for name, kwargs in configs[rep % len(configs):] + configs[:rep % len(configs)]:
                own.clear()
                gen2.clear()
                n0 = len(timer.canary_us)
                a0, m0 = alloc_counts(dev), time.thread_time()
                with installed(model, kwargs) as h:
                    handle[0] = h
                    timer.canary = None if h is None else (lambda h=h: h.host_us)
                    steps, _ = run_once(model, ps, new, timer, CAPTURE_AFTER)
                handle[0] = None
                main_cpu, a1 = time.thread_time() - m0, alloc_counts(dev)
                canary = timer.canary_us[n0:][-len(steps):]
                parts = {p: statistics.median(v[-len(steps):]) for p, v in own.items()}
                print(f"repeat {rep} {name:16s} step {1e3 * statistics.median(steps):8.2f} ms  canary "
                      f"{statistics.median(canary):7.1f} us  " + "  ".join(f"{p} {v:8.1f}" for p, v in parts.items())
                      + f"  main thread cpu {1e3 * main_cpu:.1f} ms  gen-2 collections {len(gen2)}, "
                      f"{1e3 * sum(gen2):.1f} ms  " + "  ".join(f"{k} {a1[k] - a0[k]}" for k in ALLOC_KEYS),
                      flush=True)
                if rep:
                    for key, v in (("step", 1e6 * statistics.median(steps)), ("canary", statistics.median(canary)),
                                   *parts.items()):
                        summary[name].setdefault(key, []).append(v)
    print("medians over the repeats, us per decode step:")
    for name, vals in summary.items():
        print(f"  {name:16s} " + "  ".join(f"{k} {statistics.median(v):9.1f}" for k, v in vals.items()))


if __name__ == "__main__":
    main()
