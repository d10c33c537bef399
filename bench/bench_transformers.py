"""transformers continuous batching with kvcanary: step-time overhead of each canary config, same-run ratios."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
from kvcanary.program import CAPTURE_AFTER

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# ~1.1 B parameters: 16 layers, hidden 2048, GQA 32 q / 8 kv heads of 64, vocab 32 000 (issue 13's benchmark row)
LLAMA_1B = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 4096}
# a CPU smoke size of the same shape (the benchmark's own check that it runs; its numbers mean nothing)
LLAMA_TINY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}
# canary configs measured against the baseline: (name, CanaryConfig kwargs, overhead target in %)
VARIANTS: list[tuple[str, dict[str, Any], float]] = [
    ("fingerprint none", {"fingerprint": "none"}, 1.0),
    ("defaults (partial, seal, reuse, rolling sweep)", {}, 2.0),
]
# --parts: the default policy taken apart (which part costs what), each against the same baseline
PARTS: list[tuple[str, dict[str, Any], float]] = [
    ("partial only", {"seal": False, "reuse_check": False, "sweep_slice": 0}, 2.0),
    ("partial + seal", {"reuse_check": False, "sweep_slice": 0}, 2.0),
    ("partial + rolling sweep", {"seal": False, "reuse_check": False}, 2.0),
    ("defaults without structural check", {"structural_check": False}, 2.0),
    ("defaults, a rolling-sweep slice every step", {"sweep_roll_interval": 1}, 2.0),
]
PAGE = 16
# a step whose GPU is busy at most this share of its wall time is host-bound (the attribution's condition)
HOST_BOUND_BUSY_PCT = 50.0
TIMELINE_STEPS = 8  # decode steps past the skipped ones in each profiled run
Config = tuple[str, dict[str, Any] | None]  # (name, CanaryConfig kwargs; None: no canary, the baseline)
T = TypeVar("T")


def build_model(cfg: dict[str, Any], device: str, dtype: torch.dtype) -> Any:
    """A random Llama of ``cfg`` (sdpa, eval mode): the weights do not matter, the shapes and the cache do."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llama = LlamaConfig(**cfg, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(llama).eval().to(device=device, dtype=dtype)
    model.set_attn_implementation("sdpa")
    return model


def prompts(batch: int, length: int, vocab: int, seed: int = 1) -> list[list[int]]:
    """``batch`` distinct random prompts of ``length`` tokens (no shared prefix: every step decodes ``batch`` rows)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (length,), generator=g).tolist() for _ in range(batch)]


@contextlib.contextmanager
def installed(model: Any, kwargs: dict[str, Any] | None) -> Iterator[Any]:
    """kvcanary installed on ``model`` with ``CanaryConfig(mode="raise", **kwargs)`` for the block (None: nothing
    installed, the baseline); yields the handle (or None), uninstalled on the way out."""
    from kvcanary.config import CanaryConfig
    from kvcanary.integrations import transformers as kt

    handle = kt.install(model, CanaryConfig(mode="raise", **kwargs)) if kwargs is not None else None
    try:
        yield handle
    finally:
        if handle is not None:
            handle.uninstall()


def configs_of(variants: list[tuple[str, dict[str, Any], float]]) -> list[Config]:
    """The baseline, then each variant's (name, kwargs)."""
    return [("baseline", None)] + [(n, k) for n, k, _ in variants]


class StepTimer:
    """Times every generation step as transformers' loop runs it (synchronized): the loop body that prepared, ran and
    updated a batch, so every kvcanary wrapper of the step (the bracket, the batch snapshot, the block lifecycle) is
    inside the timed region. The processor's own ``_generation_step`` would not do: the canary wraps it per instance,
    outside a class-level timer. Loop turns that found no batch are not steps.

    ``canary`` (set per run; None: no canary) reads kvcanary's cumulative host µs; each step's share is kept in
    ``canary_us``, read outside the timed region. ``markers``: each loop turn is bracketed on the GPU timeline by two
    ``torch.cuda._sleep`` kernels (:data:`MARK`), each launched on an idle device, for :func:`timeline_steps`."""

    def __init__(self, device: str, markers: bool = False) -> None:
        from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

        self.cls, self.device, self.markers = ContinuousBatchingManager, device, markers
        self.orig = ContinuousBatchingManager._generation_loop_body
        self.steps: list[float] = []
        self.canary_us: list[float] = []
        self.canary: Callable[[], int] | None = None

    def __enter__(self) -> StepTimer:
        orig, steps, sync, mark = self.orig, self.steps, self._sync, self._mark

        def timed(mgr: Any, batch_processor: Any, bootstrapping: bool) -> bool:
            sync()
            mark()
            c0 = self.canary() if self.canary is not None else 0
            before, t = mgr.current_batch, time.perf_counter()
            out: bool = orig(mgr, batch_processor, bootstrapping)
            sync()
            dt = time.perf_counter() - t
            mark()
            if mgr.current_batch != before:
                steps.append(dt)
                self.canary_us.append(float(self.canary() - c0) if self.canary is not None else 0.0)
            return out
        self.cls._generation_loop_body = timed
        return self

    def __exit__(self, *exc: object) -> None:
        self.cls._generation_loop_body = self.orig

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def _mark(self) -> None:
        if self.markers:
            torch.cuda._sleep(10)
            torch.cuda.synchronize()


MARK = "spin_kernel"  # torch.cuda._sleep's kernel


def timeline_steps(events: Any) -> list[dict[str, float]]:
    """Per loop turn that ran GPU work, from a torch.profiler's CUDA events of a run under ``StepTimer(markers=True)``:
    the turn's span between its markers (wall time, µs), the GPU's busy time in it (union of kernel and copy
    intervals), kvcanary's kernels' summed time and their count."""
    gpu = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                 if e.device_type == torch.autograd.DeviceType.CUDA)
    marks = [(a, b) for a, b, n in gpu if MARK in n]
    if len(marks) % 2:  # two per loop turn: an odd count means lost events, and every later pair would be wrong
        raise RuntimeError(f"{len(marks)} step markers in the profile: the profiler lost events")
    rows = []
    for (_, t0), (t1, _) in zip(marks[0::2], marks[1::2], strict=False):
        inside = [(a, b, n) for a, b, n in gpu if a >= t0 and b <= t1 and MARK not in n]
        if not inside:
            continue  # a loop turn that ran no batch
        canary = [b - a for a, b, n in inside if "kvcanary" in n]
        rows.append({"wall_us": t1 - t0, "gpu_busy_us": _union_us([(a, b) for a, b, _ in inside]),
                     "canary_gpu_us": sum(canary), "canary_kernels": float(len(canary))})
    return rows


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def run_once(model: Any, ps: list[list[int]], new_tokens: int, timer: StepTimer,
             skip: int = 0) -> tuple[list[float], list[list[int]]]:
    """One generate_batch: the decode-step times (prefill steps and the first ``skip`` decode steps dropped) and the
    generated tokens."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    blocks = len(ps) * (-(-(len(ps[0]) + new_tokens) // PAGE)) + 16
    cb = ContinuousBatchingConfig(page_size=PAGE, num_blocks=blocks, max_batch_tokens=max(1024, len(ps) * 64),
                                  allow_block_sharing=True, use_cuda_graph=False, use_async_batching=False,
                                  auto_switch_to_flash=False, max_blocks_per_request=0)
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    n = len(timer.steps)
    out = model.generate_batch(ps, generation_config=gen, continuous_batching_config=cb, warmup=False)
    return decode_steps(timer.steps[n:], new_tokens, skip), [r.generated_tokens for r in out.values()]


def decode_steps(per_step: list[T], new_tokens: int, skip: int) -> list[T]:
    """The decode steps' entries of one run's per-step values: the last ``new_tokens - 1`` steps decode every row
    (earlier ones prefill), less the first ``skip``."""
    return per_step[-(new_tokens - 1):][skip:]


def measure(model: Any, ps: list[list[int]], new_tokens: int, repeats: int, device: str,
            variants: list[tuple[str, dict[str, Any], float]], skip: int = 0) -> dict[str, Any]:
    """Interleaved repeats of baseline and every variant. Each repeat pairs a variant's median decode step with the
    baseline's of the same repeat (the host's speed drifts between repeats, far more than the targets); the overhead is
    the median of the pairs. Each repeat runs the configs in a rotated order (the first run of a repeat was the fastest
    or slowest by up to 20 % on an H100 host). Verdict from the pairs (:func:`_verdict`): met only when their upper
    quartile and their spread are both within the target, missed when every pair is above it. ``skip``: decode steps
    dropped from the front of every run (the canary's eager stages run from CUDA graphs from the
    ``program.CAPTURE_AFTER``-th run of a shape on, so skipping that many times the steady state).

    The same runs also give each decode step's attributed overhead: kvcanary's host time in the step (its handle's
    ``host_us``) against the rest of the step. On CUDA one more profiled run per config measures the GPU's busy share
    of a decode step; where it is at most :data:`HOST_BOUND_BUSY_PCT` the step is host-bound, the canary's kernels
    run in the GPU's idle time and its host time adds to the step one for one: a lower bound of its cost, which does
    not see what it may cost transformers' own code. ``met_attributed``: that bound's upper quartile over the steps
    within the target. ``met`` (:func:`_combined`): missed when the bound is over the target, else the pairs'."""
    names = ["baseline"] + [n for n, _, _ in variants]
    step_ms: dict[str, list[float]] = {n: [] for n in names}
    rep_ms: dict[str, list[float]] = {n: [] for n in names}  # each repeat's median decode step
    host_ms: dict[str, list[float]] = {n: [] for n in names[1:]}
    life_ms: dict[str, list[float]] = {n: [] for n in names[1:]}  # the block lifecycle wrappers' host time
    attributed: dict[str, list[float]] = {n: [] for n in names[1:]}  # per decode step: canary host / the rest, %
    canary_ms: dict[str, list[float]] = {n: [] for n in names[1:]}  # per decode step: kvcanary's host time
    ref: list[list[int]] | None = None
    configs = configs_of(variants)
    with StepTimer(device) as timer:
        for rep in range(repeats + 1):  # repetition 0 warms up (allocator, kernels, backend load)
            for name, kwargs in configs[rep % len(configs):] + configs[:rep % len(configs)]:
                n0 = len(timer.steps)
                with installed(model, kwargs) as handle:
                    timer.canary = None if handle is None else (lambda h=handle: h.host_us)
                    decode, out = run_once(model, ps, new_tokens, timer, skip)
                canary_us = decode_steps(timer.canary_us[n0:], new_tokens, skip)
                print(f"repeat {rep} {name}: decode step median {1e3 * statistics.median(decode):.2f} ms",
                      file=sys.stderr, flush=True)
                ref = out if ref is None else ref
                if out != ref:
                    raise RuntimeError(f"{name}: kvcanary changed the generated tokens")
                if handle is not None and (handle.total_violations or handle.errors):
                    raise RuntimeError(f"{name}: {handle.total_violations} violations, errors {handle.errors}")
                if rep == 0:
                    continue
                step_ms[name] += [1e3 * s for s in decode]
                rep_ms[name].append(1e3 * statistics.median(decode))
                if handle is not None:
                    st = handle.stats
                    host_ms[name].append(1e-3 * st["bracket_us"] / st["forwards"])
                    life_ms[name].append(1e-3 * st["lifecycle_us"] / st["forwards"])
                    attributed[name] += [100.0 * c / (1e6 * s - c) for s, c in zip(decode, canary_us, strict=True)]
                    canary_ms[name] += [1e-3 * c for c in canary_us]
    # a shorter run: the profiler's events of a whole run take longer to read than the run itself
    timeline = _timeline(model, ps, skip + TIMELINE_STEPS + 1, skip, configs) if device == "cuda" else {}
    med = statistics.median
    base = rep_ms["baseline"]
    spread = 100.0 * (max(base) - min(base)) / med(base)
    rows: list[dict[str, Any]] = [{"config": "baseline", "decode_step_ms": round(med(step_ms["baseline"]), 3),
                                   "repeat_spread_pct": round(spread, 2), **timeline.get("baseline", {})}]
    for name, _, target in variants:
        pairs = sorted(100.0 * (v / b - 1.0) for v, b in zip(rep_ms[name], base, strict=True))
        att = sorted(attributed[name])
        gpu = timeline.get(name, {})
        # where the GPU idles through most of the step the canary's host time adds to it one for one: a lower bound
        # of its cost (its kernels fit in the idle time; what it costs transformers' own code is not in it)
        host_bound = gpu.get("gpu_busy_pct", 100.0) <= HOST_BOUND_BUSY_PCT
        met_pairs, met_att = _verdict(pairs, target), _quartiles(att)[1] <= target
        rows.append({"config": name, "decode_step_ms": round(med(step_ms[name]), 3),
                     "overhead_pct": round(med(pairs), 2), "pair_overheads_pct": [round(p, 2) for p in pairs],
                     "attributed_overhead_pct": round(med(att), 3),
                     "attributed_upper_quartile_pct": round(_quartiles(att)[1], 3),
                     "canary_host_ms_per_step": round(med(canary_ms[name]), 3),
                     "target_pct": target, "met_pairs": met_pairs, "met_attributed": met_att if host_bound else None,
                     "met": _combined(met_pairs, met_att if host_bound else None),
                     "bracket_host_ms": round(med(host_ms[name]), 3),
                     "lifecycle_host_ms": round(med(life_ms[name]), 3), **gpu})
    return {"rows": rows, "decode_steps_per_config": len(step_ms["baseline"])}


def _timeline(model: Any, ps: list[list[int]], new_tokens: int, skip: int,
              configs: list[Config]) -> dict[str, dict[str, float]]:
    """One more run per config under torch.profiler (CUDA activity): the decode steps' GPU busy share of their wall
    time and kvcanary's kernels per step, medians (:func:`timeline_steps`)."""
    from torch.profiler import ProfilerActivity, profile

    out: dict[str, dict[str, float]] = {}
    with StepTimer("cuda", markers=True) as timer:
        for name, kwargs in configs:
            with installed(model, kwargs), profile(activities=[ProfilerActivity.CUDA]) as prof:
                run_once(model, ps, new_tokens, timer)
            rows = decode_steps(timeline_steps(prof.events()), new_tokens, skip)
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            out[name] = {"gpu_busy_pct": round(100.0 * med["gpu_busy_us"] / med["wall_us"], 2),
                         "canary_gpu_us_per_step": round(med["canary_gpu_us"], 1),
                         "canary_kernels_per_step": med["canary_kernels"]}
    return out


def _verdict(pairs: list[float], target: float) -> bool | None:
    """Met when the upper quartile of the sorted ``pairs`` is within the target and their interquartile spread is too
    (noise must not make a met); missed when every pair is above the target; else None."""
    lo, hi = _quartiles(pairs)
    if hi <= target and hi - lo <= target:
        return True
    return False if pairs[0] > target else None


def _combined(pairs: bool | None, lower_bound: bool | None) -> bool | None:
    """The row's verdict from the pairs' and the attributed lower bound's: missed when the lower bound is over the
    target (the cost is at least that), else the pairs' (a lower bound within the target shows nothing met)."""
    return False if lower_bound is False else pairs


def _quartiles(xs: list[float]) -> tuple[float, float]:
    """Lower and upper quartile of sorted ``xs`` (the values themselves for fewer than 4)."""
    if len(xs) < 4:
        return xs[0], xs[-1]
    q = statistics.quantiles(xs, n=4)
    return q[0], q[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", choices=("1b", "tiny"), default="1b")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=33)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-decode", type=int, default=0,
                    help=f"decode steps dropped from the front of every run ({CAPTURE_AFTER}: the canary's eager "
                    "stages run from their CUDA graphs, its steady state)")
    ap.add_argument("--parts", action="store_true", help="also the default policy's parts, one at a time")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if not 0 <= a.skip_decode < a.new_tokens - 1:
        ap.error(f"--skip-decode must be in [0, {a.new_tokens - 1}) for {a.new_tokens} new tokens")
    cfg = LLAMA_1B if a.model == "1b" else LLAMA_TINY
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    model = build_model(cfg, a.device, dtype)
    res = measure(model, prompts(a.batch, a.prompt, cfg["vocab_size"]), a.new_tokens, a.repeats, a.device,
                  VARIANTS + (PARTS if a.parts else []), a.skip_decode)
    for r in res["rows"]:
        print(json.dumps(r))
    out = {"machine": platform.node(), "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
           "command": f"python -m bench.bench_transformers --device {a.device} --model {a.model} --batch {a.batch} "
                      f"--prompt {a.prompt} --new-tokens {a.new_tokens} --repeats {a.repeats}"
                      + (" --parts" if a.parts else "") + (f" --skip-decode {a.skip_decode}" if a.skip_decode else ""),
           "model": cfg, "params": sum(p.numel() for p in model.parameters()), "dtype": str(dtype),
           "page_size": PAGE, "note": "decode-step time of transformers continuous batching (sdpa paged cache, no "
           "CUDA graphs): each loop step that ran a batch, canary wrappers included, synchronized; overhead = median "
           "over repeats of the variant's median step against the same repeat's baseline; attributed overhead = per "
           "decode step, kvcanary's host time (bracket, batch snapshot, block lifecycle) against the rest of the "
           "step, a lower bound of its cost where the profiled GPU busy share shows the step host-bound; met = missed "
           "when that bound is over the target, else the pairs' verdict", **res}
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
