"""Probe (GPU machine): is a transformers continuous-batching decode step bound by the host or the GPU, and what of it
is kvcanary's? For each config (baseline: no canary; then the canary's configs), one generate_batch under
torch.profiler (CUDA activity only: no host-side events, which a background thread's ops do not reliably give);
each loop turn is bracketed on the GPU timeline by two marker kernels, launched on an idle device (synchronized
first), so the span between them is the turn's wall time. Per decode step past the first ``SKIP`` (the canary's eager
stages run from graphs by then): that span, the GPU's busy time in it (union of kernel and copy intervals), kvcanary's
kernels' time and count, the wait from the start marker to the first GPU work. Usage: [NEW=n] [SKIP=k] python3
gpu/profile_tf_step.py [batch] [prompt]"""

import os
import statistics
import sys
from typing import Any

import torch
from kvcanary.config import CanaryConfig
from kvcanary.integrations import transformers as kt
from kvcanary.program import CAPTURE_AFTER
from torch.profiler import ProfilerActivity, profile

from bench.bench_transformers import LLAMA_1B, build_model, prompts, run_once

MARK = "spin_kernel"  # torch.cuda._sleep's kernel


class MarkedSteps:
    """Every generation loop turn between two marker kernels (synchronized before each, so its GPU work lies between
    them)."""

    def __init__(self) -> None:
        from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

        self.cls = ContinuousBatchingManager
        self.orig = ContinuousBatchingManager._generation_loop_body
        self.steps: list[float] = []  # run_once reads the decode steps off the end

    def __enter__(self) -> "MarkedSteps":
        orig = self.orig

        def marked(mgr: Any, proc: Any, bootstrapping: bool) -> bool:
            torch.cuda.synchronize()
            before = mgr.current_batch
            torch.cuda._sleep(10)
            out: bool = orig(mgr, proc, bootstrapping)
            torch.cuda.synchronize()
            torch.cuda._sleep(10)
            torch.cuda.synchronize()
            if mgr.current_batch != before:
                self.steps.append(0.0)
            return out
        self.cls._generation_loop_body = marked
        return self

    def __exit__(self, *exc: object) -> None:
        self.cls._generation_loop_body = self.orig


def union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def step_rows(prof: Any, new_tokens: int, skip: int) -> list[dict[str, float]]:
    gpu = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA)
    marks = [(a, b) for a, b, n in gpu if MARK in n]
    rows = []
    for (_, t0), (t1, _) in zip(marks[0::2], marks[1::2], strict=False):
        inside = [(a, b, n) for a, b, n in gpu if a >= t0 and b <= t1 and MARK not in n]
        if not inside:
            continue  # a loop turn that ran no batch
        canary = [(a, b) for a, b, n in inside if "kvcanary" in n]
        rows.append({"wall_us": t1 - t0, "gpu_busy_us": union_us([(a, b) for a, b, _ in inside]),
                     "canary_gpu_us": sum(b - a for a, b in canary), "canary_kernels": float(len(canary)),
                     "first_gpu_us": min(a for a, _, _ in inside) - t0, "gpu_items": float(len(inside))})
    decode = rows[-(new_tokens - 1):]
    return decode[skip:]


def main() -> None:
    batch, prompt = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (32, 1024)
    new_tokens, skip = int(os.environ.get("NEW", "49")), int(os.environ.get("SKIP", str(CAPTURE_AFTER)))
    model = build_model(LLAMA_1B, "cuda", torch.bfloat16)
    ps = prompts(batch, prompt, LLAMA_1B["vocab_size"])
    configs: list[tuple[str, dict[str, Any] | None]] = [("baseline", None), ("defaults", {}),
                                                        ("fingerprint none", {"fingerprint": "none"})]
    with MarkedSteps() as marked:
        run_once(model, ps, 9, marked)  # warm-up: allocator, kernels, the canary's natives
        h = kt.install(model, CanaryConfig(mode="raise"))
        run_once(model, ps, 9, marked)
        h.uninstall()
        for name, kwargs in configs:
            handle = kt.install(model, CanaryConfig(mode="raise", **kwargs)) if kwargs is not None else None
            try:
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    run_once(model, ps, new_tokens, marked)
            finally:
                if handle is not None:
                    handle.uninstall()
            rows = step_rows(prof, new_tokens, skip)
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            print(f"{name:18s} steps {len(rows):3d}  " + "  ".join(f"{k} {v:9.1f}" for k, v in med.items()),
                  flush=True)
            if name == "defaults":
                by_name: dict[str, list[float]] = {}
                for e in prof.events():
                    if e.device_type == torch.autograd.DeviceType.CUDA and "kvcanary" in e.name:
                        by_name.setdefault(e.name[:90], []).append(e.time_range.end - e.time_range.start)
                for n, ds in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]:
                    print(f"    {n:90s} n={len(ds):5d} median {statistics.median(ds):7.2f} us")


if __name__ == "__main__":
    main()
