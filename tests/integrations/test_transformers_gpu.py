"""kvcanary inside transformers 5.23.0 continuous batching on CUDA: clean, detecting, and its overhead per step."""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

import pytest
import torch
from hf_util import PAGE, cb_config, full_alloc, gen_config, run_manager, shared_prefix_prompts, tiny_llama
from kvcanary.config import CanaryConfig
from kvcanary.integrations import transformers as kt
from kvcanary.manager import CanaryManager
from kvcanary.report import CanaryViolationError
from kvcanary_schema import FailReason, LaunchTag

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# a small but not toy model: 8 layers, 8 KV heads of 64 (1 KiB K row in bf16), page 16
MODEL = {"vocab_size": 2048, "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 8,
         "num_attention_heads": 8, "num_key_value_heads": 8, "max_position_embeddings": 2048}
BATCH, PREFIX, TAIL, NEW, REPEATS = 16, 192, 64, 32, 5


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_llama("cuda", torch.bfloat16, **MODEL)


def _prompts() -> list[list[int]]:
    return shared_prefix_prompts(PREFIX, [TAIL + i for i in range(BATCH)])


def _run(model: Any, prompts: list[list[int]], steps: list[float]) -> tuple[float, list[list[int]]]:
    """One generate_batch; appends the time of each generation step (synchronized) to ``steps``; returns the sum."""
    n = len(steps)
    out = model.generate_batch(prompts, generation_config=gen_config(NEW),
                               continuous_batching_config=cb_config(1024, num_blocks=1024), warmup=False)
    return sum(steps[n:]), [r.generated_tokens for r in out.values()]


def _config(fingerprint: str) -> CanaryConfig:
    return CanaryConfig(mode="raise", fingerprint=fingerprint, layer_coverage="all", sweep_interval=8, backend="cuda")


def test_overhead_per_step(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per generation step: transformers' step time (synchronized) with and without kvcanary (runs interleaved,
    medians), the bracket's host time, and the GPU time of the canary's HEAD and TAIL launches (CUDA events).

    generate_batch's wall time is dominated by its polling loop, so the steps themselves are timed.
    """
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

    steps: list[float] = []
    spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    orig_step = ContinuousBatchingManager._generation_step

    def timed(self: Any) -> None:
        torch.cuda.synchronize()
        t = time.perf_counter()
        orig_step(self)
        torch.cuda.synchronize()
        steps.append(time.perf_counter() - t)

    def evented(orig: Any) -> Any:
        def run(self: CanaryManager) -> None:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            orig(self)
            b.record()
            spans.append((a, b))
        return run

    monkeypatch.setattr(ContinuousBatchingManager, "_generation_step", timed)
    monkeypatch.setattr(CanaryManager, "pre_forward", evented(CanaryManager.pre_forward))
    monkeypatch.setattr(CanaryManager, "post_forward", evented(CanaryManager.post_forward))
    prompts = _prompts()
    variants = ("baseline", "none", "all")
    step_ms: dict[str, list[float]] = {v: [] for v in variants}
    host_ms: dict[str, list[float]] = {v: [] for v in variants[1:]}
    gpu_ms: dict[str, list[float]] = {v: [] for v in variants[1:]}
    tokens: dict[str, list[list[int]]] = {}
    forwards = 0
    for rep in range(REPEATS + 1):  # repetition 0 warms up (allocator, JIT build)
        for v in variants:
            handle = kt.install(model, _config(v)) if v != "baseline" else None
            n, k = len(steps), len(spans)
            try:
                total, out = _run(model, prompts, steps)
            finally:
                if handle is not None:
                    handle.uninstall()
            forwards = len(steps) - n
            tokens.setdefault(v, out)
            assert out == tokens["baseline"], f"kvcanary ({v}) changed the generated tokens"
            if handle is not None:
                assert handle.total_violations == 0 and handle.errors == [] and handle.stats["forwards"] == forwards
            if rep == 0:
                continue
            step_ms[v].append(1e3 * total / forwards)
            if handle is not None:
                torch.cuda.synchronize()
                host_ms[v].append(1e-3 * handle.stats["bracket_us"] / forwards)
                gpu_ms[v].append(sum(a.elapsed_time(b) for a, b in spans[k:]) / forwards)
    med = statistics.median
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "batch": BATCH, "prompt_tokens": PREFIX + TAIL, "new_tokens": NEW, "page_size": PAGE,
                               "model": MODEL, "dtype": "bfloat16", "forwards_per_run": forwards, "repeats": REPEATS,
                               "baseline_ms_per_step": med(step_ms["baseline"])}
    for v in variants[1:]:
        results[f"fingerprint_{v}"] = {
            "ms_per_step": med(step_ms[v]), "overhead_ms_per_step": med(step_ms[v]) - med(step_ms["baseline"]),
            "bracket_host_ms_per_step": med(host_ms[v]), "canary_gpu_ms_per_step": med(gpu_ms[v])}
    print(json.dumps(results, indent=1))
    out_dir = os.environ.get("KVCANARY_RESULTS_DIR")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "transformers_gpu.json"), "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)


def test_cached_block_corruption_detected_on_cuda(model: Any) -> None:
    """The CPU fault test on CUDA (compute stream, cuda backend): V of layer 3 in a cached block, then a hit."""
    prompts = shared_prefix_prompts(40, (5, 9))

    def corrupt(mgr: Any, i: int) -> None:
        if i == 0:
            alloc = full_alloc(mgr.batch_processor)
            block = next(iter(alloc.ledger.cached_blocks))
            row = alloc._kv_token_views[3][1][block * alloc.block_physical_stride + 5]
            row[0, 0] = row[0, 0] * -3.0 + 1.0

    with kt.install(model, _config("all")):
        with pytest.raises(CanaryViolationError) as info:
            run_manager(model, prompts, sequential=True, between=corrupt, max_new_tokens=3)
    vs = info.value.violations
    assert info.value.request_ids == ["r1"]
    # r1's TAIL verify, and the rolling sweep's slice of that step where it passes the block
    tags = {v.tag for v in vs}
    assert LaunchTag.TAIL_V_FULL in tags and tags <= {LaunchTag.TAIL_V_FULL, LaunchTag.SWEEP_V_FULL}
    assert all(v.reasons == FailReason.VERIFY_FINGERPRINT for v in vs)


def test_cuda_graphs_clean(model: Any) -> None:
    """use_cuda_graph=True: the bracket runs eagerly around captured/replayed forwards; same tokens, no violations."""
    prompts = shared_prefix_prompts(40, (5, 9, 17, 3))

    def run() -> list[list[int]]:
        out = model.generate_batch(prompts, generation_config=gen_config(12),
                                   continuous_batching_config=cb_config(256, use_cuda_graph=True), warmup=True)
        return [r.generated_tokens for r in out.values()]

    ref = run()
    with kt.install(model, _config("all")) as handle:
        out = run()
    assert out == ref and handle.total_violations == 0 and handle.errors == []
    assert handle.stats["forwards"] >= 12 and handle.stats.get("write_problems", 0) == 0, handle.stats


def test_every_device_op_of_the_cache_runs_on_the_compute_stream(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-stream contract (docs/transformers.md): transformers' writes of the batch inputs (prepare_batch_tensors'
    reset and copies), its block copies of a fork and the canary's stages and record copies all run with transformers'
    compute stream current, and the generation thread's own stream is current again between them. Forks
    (num_return_sequences=3) make block copies; the rolling sweep (sweep_interval=8) runs inside the bracket."""
    from transformers.generation.continuous_batching.cache_allocators.cache_allocator import CacheAllocator
    from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs

    seen: list[tuple[str, torch.cuda.Stream]] = []
    compute: list[torch.cuda.Stream] = []

    def spy(name: str, orig: Any) -> Any:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(self, ContinuousBatchingIOs) and self.compute_stream is not None:
                compute.append(self.compute_stream)
            seen.append((name, torch.cuda.current_stream()))
            return orig(self, *args, **kwargs)
        return run

    for cls, name in ((ContinuousBatchingIOs, "prepare_batch_tensors"), (CacheAllocator, "copy_blocks"),
                      (CanaryManager, "pre_forward"), (CanaryManager, "post_forward"),
                      (CanaryManager, "end_forward"), (kt.HFPoolAdapter, "copy_records")):
        monkeypatch.setattr(cls, name, spy(name, getattr(cls, name)))

    def after_step(orig: Any) -> Any:  # what the generation thread has current once a step has returned
        def step(self: Any) -> None:
            orig(self)
            seen.append(("after the step", torch.cuda.current_stream()))
        return step

    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager
    monkeypatch.setattr(ContinuousBatchingManager, "_generation_step",
                        after_step(ContinuousBatchingManager._generation_step))
    prompts = shared_prefix_prompts(40, (5, 9, 17))
    with kt.install(model, _config("all")) as handle:
        out = model.generate_batch(prompts, generation_config=gen_config(6, do_sample=True, num_return_sequences=3),
                                   continuous_batching_config=cb_config(256), warmup=False)
    assert len(out) == 9 and handle.total_violations == 0 and handle.errors == []
    assert handle.stats["blocks_copied"] > 0, handle.stats
    streams = {s.stream_id for s in compute}
    assert len(streams) == 1, streams
    (stream,) = streams
    names = {n for n, _ in seen}
    assert names >= {"prepare_batch_tensors", "copy_blocks", "copy_records", "pre_forward", "post_forward",
                     "end_forward", "after the step"}, names
    wrong = [(n, s.stream_id) for n, s in seen if (s.stream_id == stream) != (n != "after the step")]
    assert not wrong, (stream, wrong[:8])
