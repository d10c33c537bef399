"""transformers continuous batching with kvcanary: step-time overhead of each canary config, same-run ratios."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
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
CI_TAIL = 0.025  # each tail of the distribution-free confidence interval of the pairs' median (95 %)
TURN_TIMEOUT_S = 300.0  # a round-robin loop waiting longer than this for its turn raises (a run died)
Config = tuple[str, dict[str, Any] | None]  # (name, CanaryConfig kwargs; None: no canary, the baseline)
# --control: a second model with no canary, paired with the baseline as the variants are
CONTROL = "control (a second baseline, no canary)"
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
        def timed(mgr: Any, batch_processor: Any, bootstrapping: bool) -> bool:
            return _timed_turn(self.orig, mgr, batch_processor, bootstrapping, self.device, self.canary, self.steps,
                               self.canary_us, self._mark)
        self.cls._generation_loop_body = timed
        return self

    def __exit__(self, *exc: object) -> None:
        self.cls._generation_loop_body = self.orig

    def _mark(self) -> None:
        if self.markers:
            torch.cuda._sleep(10)
            torch.cuda.synchronize()


class RoundRobin:
    """Several models' continuous-batching runs (each ``generate_batch`` in its own thread), their generation loops
    taking turns: one loop turn each per round, the order rotated every round. Every model's i-th step runs within
    one round, so the host's drift (10-70 % between runs seconds apart on the GPU hosts) is common to a round's steps
    and their pairs measure the canary, not the host. Each turn that ran a batch is timed (synchronized) into
    ``steps[name]``, kvcanary's host µs in it into ``canary_us[name]`` (``canary[name]`` reads the handle's
    cumulative count; None: no canary). No turn starts before every model's loop has joined.

    ``cpu``: the core every loop thread is pinned to when it joins (None: not pinned). Unpinned, each loop thread
    stays on a core of its own, and on an H100 host one model's steps ran 20 % slower than the others' for whole
    runs: the pairs then measured the cores, not the canary (``bench/results/host_session22``). Only one loop runs at a
    time, so one core serves them all."""

    def __init__(self, device: str, models: dict[str, Any], canary: dict[str, Callable[[], int] | None],
                 cpu: int | None = None, spin: dict[str, Callable[[], None]] | None = None) -> None:
        from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

        self.cls, self.device, self.canary, self.cpu = ContinuousBatchingManager, device, canary, cpu
        self.spin = spin or {}  # per model: what its every turn busy-waits on inside the timed region (:func:`spin`)
        self.orig = ContinuousBatchingManager._generation_loop_body
        self.name_of = {id(m): n for n, m in models.items()}
        self.steps: dict[str, list[float]] = {n: [] for n in models}
        self.canary_us: dict[str, list[float]] = {n: [] for n in models}
        self.cv = threading.Condition()
        self.joined: set[str] = set()
        self.order: list[str] = []  # the loops still running, in this round's order
        self.turns: list[str] = []  # whose loop turn ran, in order (every turn, with a batch or without)
        self.pos = 0  # whose turn it is: an index into order

    def run(self, models: dict[str, Any], ps: list[list[int]], new_tokens: int) -> dict[str, list[list[int]]]:
        """One ``generate_batch`` per model, concurrently, their loop turns in rounds; each model's generated tokens."""
        def turn(mgr: Any, batch_processor: Any, bootstrapping: bool) -> bool:
            return self._turn(mgr, batch_processor, bootstrapping)
        self.cls._generation_loop_body = turn
        try:
            with ThreadPoolExecutor(len(models)) as pool:
                futures = {n: pool.submit(generate, m, ps, new_tokens) for n, m in models.items()}
                outs = {n: f.result() for n, f in futures.items()}
        finally:
            self.cls._generation_loop_body = self.orig
        for name, out in outs.items():  # transformers logs a failed loop and returns what it has
            if len(out) != len(ps):
                raise RuntimeError(f"round robin: {name}'s run returned {len(out)} of {len(ps)} requests")
        return outs

    def _turn(self, mgr: Any, batch_processor: Any, bootstrapping: bool) -> bool:
        name = self.name_of[id(mgr.model)]
        with self.cv:
            if name not in self.joined:
                if self.cpu is not None:
                    os.sched_setaffinity(threading.get_native_id(), {self.cpu})
                self.joined.add(name)
                self.order.append(name)
                self.cv.notify_all()
            if not self.cv.wait_for(lambda: len(self.joined) == len(self.name_of) and self.order[self.pos] == name,
                                    TURN_TIMEOUT_S):
                raise RuntimeError(f"round robin: {name}'s loop waited {TURN_TIMEOUT_S} s for its turn")
        self.turns.append(name)
        out = False
        try:
            out = _timed_turn(self.orig, mgr, batch_processor, bootstrapping, self.device, self.canary[name],
                              self.steps[name], self.canary_us[name], spin=self.spin.get(name))
            return out
        finally:
            with self.cv:
                self._pass(name, keep=out)
                self.cv.notify_all()

    def _pass(self, name: str, keep: bool) -> None:
        """The turn after ``name``'s; a loop that ended (``keep`` False) leaves the rotation."""
        if keep:
            self.pos += 1
        else:
            self.order.remove(name)  # the next loop moves into this position
        if self.pos >= len(self.order):
            self.pos = 0
            self.order = self.order[1:] + self.order[:1]


def _timed_turn(orig: Callable[..., bool], mgr: Any, batch_processor: Any, bootstrapping: bool, device: str,
                canary: Callable[[], int] | None, steps: list[float], canary_us: list[float],
                mark: Callable[[], None] | None = None, spin: Callable[[], None] | None = None) -> bool:
    """One loop turn of transformers' generation loop, synchronized before and after; a turn that ran a batch appends
    its wall time to ``steps`` and kvcanary's host µs in it (``canary`` reads the cumulative count) to ``canary_us``.
    ``mark`` runs just outside the timed region on both sides; ``spin``: run inside it, before the turn."""
    _sync(device)
    if mark is not None:
        mark()
    c0 = canary() if canary is not None else 0
    before, t = mgr.current_batch, time.perf_counter()
    if spin is not None:
        spin()
    out = orig(mgr, batch_processor, bootstrapping)
    _sync(device)
    dt = time.perf_counter() - t
    if mark is not None:
        mark()
    if mgr.current_batch != before:
        steps.append(dt)
        canary_us.append(float(canary() - c0) if canary is not None else 0.0)
    return out


def spin(seconds: float, walk: np.ndarray | None = None) -> None:
    """Busy-wait ``seconds`` on the host: CPU time that touches almost no memory (the calibration's added work), or,
    with ``walk``, that reads through that buffer meanwhile, chunk after chunk (added work that evicts the caches, as
    a canary's calls between the engine's do)."""
    end, at = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        if walk is not None:
            walk[at:at + WALK_CHUNK].sum()
            at = (at + WALK_CHUNK) % walk.shape[0]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


MARK = "spin_kernel"  # torch.cuda._sleep's kernel
WALK_CHUNK = 4096  # int64 elements a memory-walking spin reads between two clock reads (32 KiB)


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
    """One generate_batch under ``timer``: the decode-step times (prefill steps and the first ``skip`` decode steps
    dropped) and the generated tokens."""
    n = len(timer.steps)
    out = generate(model, ps, new_tokens)
    return decode_steps(timer.steps[n:], new_tokens, skip), out


def generate(model: Any, ps: list[list[int]], new_tokens: int) -> list[list[int]]:
    """One generate_batch of ``ps`` (greedy, ``new_tokens`` each, no CUDA graphs, no block table); the generated
    tokens."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    blocks = len(ps) * (-(-(len(ps[0]) + new_tokens) // PAGE)) + 16
    cb = ContinuousBatchingConfig(page_size=PAGE, num_blocks=blocks, max_batch_tokens=max(1024, len(ps) * 64),
                                  allow_block_sharing=True, use_cuda_graph=False, use_async_batching=False,
                                  auto_switch_to_flash=False, max_blocks_per_request=0)
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    out = model.generate_batch(ps, generation_config=gen, continuous_batching_config=cb, warmup=False)
    return [r.generated_tokens for r in out.values()]


def decode_steps(per_step: list[T], new_tokens: int, skip: int) -> list[T]:
    """The decode steps' entries of one run's per-step values: the last ``new_tokens - 1`` steps decode every row
    (earlier ones prefill), less the first ``skip``."""
    return per_step[-(new_tokens - 1):][skip:]


def measure(make_model: Callable[[], Any], ps: list[list[int]], new_tokens: int, repeats: int, device: str,
            variants: list[tuple[str, dict[str, Any], float]], skip: int = 0,
            loop_cpu: int | None = None, control: bool = False, spin_us: float = 0.0,
            spin_kib: int = 0) -> dict[str, Any]:
    """Repeats of the baseline and every variant run side by side: one model each (``make_model``, identical
    weights), their generation loops taking turns step by step (:class:`RoundRobin`), so the host's drift is common to
    a round. Each decode step of a variant pairs with the baseline's step of the same round; the overhead is the
    median of the pairs over every repeat, with its distribution-free 95 % confidence interval. Verdict from that
    interval (:func:`_verdict`): met when it lies within the target, missed when it lies above it. Repeat 0 warms up.
    ``skip``: decode steps dropped from the front of every run (the canary's eager stages run from CUDA graphs from
    the ``program.CAPTURE_AFTER``-th run of a shape on, so skipping that many times the steady state). ``loop_cpu``:
    the core the generation loops run on (:class:`RoundRobin`'s ``cpu``).

    The same runs also give each decode step's attributed overhead: kvcanary's host time in the step (its handle's
    ``host_us``) against the rest of the step. On CUDA one more profiled run per config measures the GPU's busy share
    of a decode step; where it is at most :data:`HOST_BOUND_BUSY_PCT` the step is host-bound, the canary's kernels
    run in the GPU's idle time and its host time adds to the step one for one: a lower bound of its cost, which does
    not see what it may cost transformers' own code. ``met_attributed``: that bound's upper quartile over the steps
    within the target. ``met`` (:func:`_combined`): missed when the bound is over the target, else the pairs'.

    ``control``: one more model with no canary (:data:`CONTROL`), paired with the baseline like a variant: its pairs
    measure the setup's own offset between two identical models (its row: the median and interval; an interval
    that excludes 0 says the variants' intervals are narrower than the setup's error). Each variant's step also
    pairs with the control's step of its round (``overhead_vs_control_pct``, its interval, ``met_vs_control``): two
    models that are not the baseline, so an offset of the baseline's own (the control's median was -0.08 to +0.62 %
    in the six H200 calls of bench/results/host_session23-25) cancels; the row's ``met`` stays the baseline pairs'.

    ``spin_us``: one more model with no canary whose every step also busy-waits ``spin_us`` on the host (:func:`spin`),
    paired with the baseline like a variant: the pairs' calibration. Its row puts the pairs' median next to what the
    spin alone adds (``expected_pct``, the median of spin / (step - spin)); pairs above that say the setup adds to a
    model's host work, pairs near it that a variant's excess over its attributed bound is its own. ``spin_kib``: the
    spin reads through a buffer of that many KiB meanwhile (:func:`spin`'s ``walk``): pairs above a plain spin's say
    added host work costs the engine's own code more when it evicts the caches."""
    walk = np.ones(spin_kib * 128, dtype=np.int64) if spin_kib > 0 else None  # 128 int64 per KiB
    spun = (f"host spin {spin_us:g} us" + (f" reading {spin_kib} KiB" if walk is not None else "") + " (no canary)") \
        if spin_us > 0 else ""
    extra = ([CONTROL] if control else []) + ([spun] if spun else [])
    configs = configs_of(variants) + [(n, None) for n in extra]
    paired = [n for n, _, _ in variants] + extra
    models = {name: make_model() for name, _ in configs}
    step_ms: dict[str, list[float]] = {n: [] for n in models}
    base_ms: list[float] = []  # each repeat's median baseline decode step (the spread of the host between repeats)
    pairs: dict[str, list[float]] = {n: [] for n in paired}  # per round: variant / baseline step - 1, %
    rep_pairs: dict[str, list[float]] = {n: [] for n in paired}  # each repeat's median pair
    vs_control: dict[str, list[float]] = {n: [] for n, _, _ in variants}  # per round: variant / control step - 1, %
    host_ms: dict[str, list[float]] = {n: [] for n, _, _ in variants}
    life_ms: dict[str, list[float]] = {n: [] for n, _, _ in variants}  # the block lifecycle wrappers' host time
    attributed: dict[str, list[float]] = {n: [] for n, _, _ in variants}  # per decode step: canary / the rest, %
    canary_ms: dict[str, list[float]] = {n: [] for n, _, _ in variants}  # per decode step: kvcanary's host time
    ref: list[list[int]] | None = None
    for rep in range(repeats + 1):
        with contextlib.ExitStack() as stack:
            handles = {name: stack.enter_context(installed(models[name], kwargs)) for name, kwargs in configs}
            rr = RoundRobin(device, models, {n: None if h is None else (lambda h=h: h.host_us)
                                             for n, h in handles.items()}, loop_cpu,
                            {spun: functools.partial(spin, 1e-6 * spin_us, walk)} if spun else {})
            outs = rr.run(models, ps, new_tokens)
        decode = {n: decode_steps(rr.steps[n], new_tokens, skip) for n in models}
        medians = {n: 1e3 * statistics.median(d) for n, d in decode.items()}
        print(f"repeat {rep}: decode step medians " + ", ".join(f"{n} {m:.2f} ms" for n, m in medians.items()),
              file=sys.stderr, flush=True)
        for name, out in outs.items():
            ref = out if ref is None else ref
            if out != ref:
                raise RuntimeError(f"{name}: kvcanary changed the generated tokens")
            h = handles[name]
            if h is not None and (h.total_violations or h.errors):
                raise RuntimeError(f"{name}: {h.total_violations} violations, errors {h.errors}")
        if rep == 0:  # warm-up (allocator, kernels, backend load)
            continue
        base_ms.append(medians["baseline"])
        for name in models:
            step_ms[name] += [1e3 * x for x in decode[name]]
        for name in paired:
            these = [100.0 * (v / b - 1.0) for v, b in zip(decode[name], decode["baseline"], strict=True)]
            pairs[name] += these
            rep_pairs[name].append(statistics.median(these))
            if control and name in vs_control:
                vs_control[name] += [100.0 * (v / c - 1.0) for v, c in zip(decode[name], decode[CONTROL], strict=True)]
        for name, _, _ in variants:
            st, canary_us = handles[name].stats, decode_steps(rr.canary_us[name], new_tokens, skip)
            host_ms[name].append(1e-3 * st["bracket_us"] / st["forwards"])
            life_ms[name].append(1e-3 * st["lifecycle_us"] / st["forwards"])
            attributed[name] += [100.0 * c / (1e6 * x - c) for x, c in zip(decode[name], canary_us, strict=True)]
            canary_ms[name] += [1e-3 * c for c in canary_us]
    for name in paired:  # before the profiled runs: a call that runs out of time still has these
        lo, hi = _median_ci(sorted(pairs[name]))
        print(f"{name}: step pairs median {statistics.median(pairs[name]):+.2f} %, 95 % interval [{lo:+.2f}, "
              f"{hi:+.2f}] over {len(pairs[name])} pairs", file=sys.stderr, flush=True)
        if vs_control.get(name):
            lo, hi = _median_ci(sorted(vs_control[name]))
            print(f"{name}: against the control, median {statistics.median(vs_control[name]):+.2f} %, 95 % interval "
                  f"[{lo:+.2f}, {hi:+.2f}]", file=sys.stderr, flush=True)
    # a shorter run: the profiler's events of a whole run take longer to read than the run itself
    timeline = _timeline(models["baseline"], ps, skip + TIMELINE_STEPS + 1, skip, configs) if device == "cuda" else {}
    med = statistics.median
    spread = 100.0 * (max(base_ms) - min(base_ms)) / med(base_ms)
    rows: list[dict[str, Any]] = [{"config": "baseline", "decode_step_ms": round(med(step_ms["baseline"]), 3),
                                   "repeat_spread_pct": round(spread, 2), **timeline.get("baseline", {})}]
    if control:
        rows.append({**_paired_row(CONTROL, step_ms[CONTROL], pairs[CONTROL]),
                     "repeat_overheads_pct": [round(p, 2) for p in rep_pairs[CONTROL]]})
    if spun:
        rows.append({**_paired_row(spun, step_ms[spun], pairs[spun]),
                     "expected_pct": round(med(100.0 * spin_us / (1e3 * x - spin_us) for x in step_ms[spun]), 3)})
    for name, _, target in variants:
        ps_sorted, att = sorted(pairs[name]), sorted(attributed[name])
        gpu = timeline.get(name, {})
        # where the GPU idles through most of the step the canary's host time adds to it one for one: a lower bound
        # of its cost (its kernels fit in the idle time; what it costs transformers' own code is not in it)
        host_bound = gpu.get("gpu_busy_pct", 100.0) <= HOST_BOUND_BUSY_PCT
        met_pairs, met_att = _verdict(ps_sorted, target), _quartiles(att)[1] <= target
        rows.append({**_paired_row(name, step_ms[name], pairs[name]),
                     "repeat_overheads_pct": [round(p, 2) for p in rep_pairs[name]],
                     "attributed_overhead_pct": round(med(att), 3),
                     "attributed_upper_quartile_pct": round(_quartiles(att)[1], 3),
                     # the amortized share: periodic work (a rolling-sweep slice every few steps, a report window
                     # every 64) weighs in by its total, not by its rank
                     "attributed_pct": _raw(attributed[name]),
                     "attributed_mean_pct": round(100.0 * sum(canary_ms[name])
                                                  / (sum(step_ms[name]) - sum(canary_ms[name])), 3),
                     "canary_host_ms_per_step": round(med(canary_ms[name]), 3),
                     "target_pct": target, "met_pairs": met_pairs, "met_attributed": met_att if host_bound else None,
                     "met": _combined(met_pairs, met_att if host_bound else None),
                     "bracket_host_ms": round(med(host_ms[name]), 3),
                     "lifecycle_host_ms": round(med(life_ms[name]), 3), **_against_control(vs_control[name], target),
                     **gpu})
    return {"rows": rows, "decode_steps_per_config": len(step_ms["baseline"]),
            "params": sum(p.numel() for p in models["baseline"].parameters())}


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


def _pair_summary(pairs: list[float], key: str) -> dict[str, Any]:
    """``{key}_pct``: the median of the step ``pairs``, ``{key}_ci95_pct``: its 95 % interval."""
    ps = sorted(pairs)
    return {f"{key}_pct": round(statistics.median(ps), 2), f"{key}_ci95_pct": [round(x, 2) for x in _median_ci(ps)]}


def _paired_row(name: str, step_ms: list[float], pairs: list[float]) -> dict[str, Any]:
    """The start of a config's row: its decode step time and its steps paired with the baseline's."""
    return {"config": name, "decode_step_ms": round(statistics.median(step_ms), 3),
            **_pair_summary(pairs, "overhead"), "step_pairs": len(pairs), "pairs_pct": _raw(pairs)}


RAW_KEYS = ("pairs_pct", "pairs_vs_control_pct", "attributed_pct")  # a row's per-step lists (in the JSON, not printed)


def _raw(xs: list[float]) -> list[float]:
    """Per-step values as the JSON keeps them (for pooling runs: bench/pool_tf_runs.py)."""
    return [round(x, 4) for x in xs]


def _against_control(pairs: list[float], target: float) -> dict[str, Any]:
    """A variant's steps paired with the control's (none without ``--control``): median, interval and verdict."""
    if not pairs:
        return {}
    return {**_pair_summary(pairs, "overhead_vs_control"), "met_vs_control": _verdict(sorted(pairs), target),
            "pairs_vs_control_pct": _raw(pairs)}


def _verdict(pairs: list[float], target: float) -> bool | None:
    """From the sorted step ``pairs``: met when the 95 % confidence interval of their median lies within the target,
    missed when it lies above it, else None (too few pairs for an interval, or it straddles the target)."""
    lo, hi = _median_ci(pairs)
    if hi <= target:
        return True
    return False if lo > target else None


def _median_ci(xs: list[float]) -> tuple[float, float]:
    """Distribution-free confidence interval of the median of sorted ``xs``, at least 1 - 2 * :data:`CI_TAIL`: the
    order statistics x_(k) and x_(n+1-k) for the largest k with P(Binomial(n, 1/2) < k) <= CI_TAIL; (-inf, inf) when
    even k = 1 is too wide a tail (fewer than 6 values)."""
    n, below, k = len(xs), 0, 0
    while k < n and (below + math.comb(n, k)) / 2 ** n <= CI_TAIL:
        below += math.comb(n, k)
        k += 1
    return (xs[k - 1], xs[n - k]) if k else (-math.inf, math.inf)


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
    ap.add_argument("--loop-cpu", type=int, default=max(os.sched_getaffinity(0)),
                    help="the core all generation loops are pinned to (default: this process's last; -1: not pinned)")
    ap.add_argument("--control", action="store_true",
                    help="also a second model with no canary, paired with the baseline: the setup's own offset")
    ap.add_argument("--only", default="",
                    help="comma-separated name prefixes: run only the variants whose names start with one of them")
    ap.add_argument("--spin-kib", type=int, default=0,
                    help="the spin model also reads through a buffer of this many KiB while it waits")
    ap.add_argument("--spin-us", type=float, default=0.0,
                    help="also a model with no canary whose steps busy-wait this long: the pairs' calibration")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if a.spin_kib and a.spin_us <= 0:
        ap.error("--spin-kib needs --spin-us (the spin model it reads memory in)")
    if not 0 <= a.skip_decode < a.new_tokens - 1:
        ap.error(f"--skip-decode must be in [0, {a.new_tokens - 1}) for {a.new_tokens} new tokens")
    cfg = LLAMA_1B if a.model == "1b" else LLAMA_TINY
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    variants = VARIANTS + (PARTS if a.parts else [])
    if a.only:
        prefixes = tuple(a.only.split(","))
        variants = [v for v in variants if v[0].startswith(prefixes)]
        if not variants:
            ap.error(f"--only {a.only!r} names no variant of {[v[0] for v in VARIANTS + PARTS]}")
    res = measure(lambda: build_model(cfg, a.device, dtype), prompts(a.batch, a.prompt, cfg["vocab_size"]),
                  a.new_tokens, a.repeats, a.device, variants, a.skip_decode,
                  None if a.loop_cpu < 0 else a.loop_cpu, a.control, a.spin_us, a.spin_kib)
    for r in res["rows"]:
        print(json.dumps({k: v for k, v in r.items() if k not in RAW_KEYS}))
    out = {"machine": platform.node(), "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
           "command": f"python -m bench.bench_transformers --device {a.device} --model {a.model} --batch {a.batch} "
                      f"--prompt {a.prompt} --new-tokens {a.new_tokens} --repeats {a.repeats}"
                      + (" --parts" if a.parts else "") + (" --control" if a.control else "")
                      + (f" --spin-us {a.spin_us:g}" if a.spin_us > 0 else "")
                      + (f" --spin-kib {a.spin_kib}" if a.spin_kib > 0 else "")
                      + (f" --only {a.only!r}" if a.only else "")
                      + (f" --skip-decode {a.skip_decode}" if a.skip_decode else "")
                      + f" --loop-cpu {a.loop_cpu}",
           "model": cfg, "dtype": str(dtype),
           "page_size": PAGE, "note": "decode-step time of transformers continuous batching (sdpa paged cache, no "
           "CUDA graphs): each loop step that ran a batch, canary wrappers included, synchronized; one model per "
           "config, their loops taking turns step by step; overhead = median over the rounds of every repeat of the "
           "variant's step against the baseline's step of the same round, with its 95 % confidence interval; "
           "attributed overhead = per "
           "decode step, kvcanary's host time (bracket, batch snapshot, block lifecycle) against the rest of the "
           "step, a lower bound of its cost where the profiled GPU busy share shows the step host-bound; met = missed "
           "when that bound is over the target, else the pairs' verdict (met: the interval within the target, "
           "missed: above it)", **res}
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
