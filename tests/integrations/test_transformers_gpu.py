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
from kvcanary.report import CanaryViolationError
from kvcanary_schema import FailReason, LaunchTag

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# a small but not toy model: 8 layers, 8 KV heads of 64 (1 KiB K row in bf16), page 16
MODEL = {"vocab_size": 2048, "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 8,
         "num_attention_heads": 8, "num_key_value_heads": 8, "max_position_embeddings": 2048}
BATCH, PREFIX, TAIL, NEW, REPEATS = 16, 192, 64, 32, 3


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_llama("cuda", torch.bfloat16, **MODEL)


def _prompts() -> list[list[int]]:
    return shared_prefix_prompts(PREFIX, [TAIL + i for i in range(BATCH)])


def _run(model: Any, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=gen_config(NEW),
                               continuous_batching_config=cb_config(1024, num_blocks=1024), warmup=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t, [r.generated_tokens for r in out.values()]


def _config(fingerprint: str) -> CanaryConfig:
    return CanaryConfig(mode="raise", fingerprint=fingerprint, layer_coverage="all", sweep_interval=8, backend="cuda")


def test_overhead_per_step(model: Any) -> None:
    """Median wall time of a whole generate_batch with and without kvcanary, divided by its forwards."""
    prompts = _prompts()
    _run(model, prompts)  # warm the allocator and kernels
    base_times, base = zip(*(_run(model, prompts) for _ in range(REPEATS)), strict=True)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "batch": BATCH, "prompt_tokens": PREFIX + TAIL, "new_tokens": NEW, "page_size": PAGE,
                               "model": MODEL, "dtype": "bfloat16", "baseline_s": statistics.median(base_times)}
    for fp in ("none", "all"):
        with kt.install(model, _config(fp)) as handle:
            _run(model, prompts)  # JIT build / first launches
            before = handle.stats["forwards"]
            times, outs = zip(*(_run(model, prompts) for _ in range(REPEATS)), strict=True)
            forwards = (handle.stats["forwards"] - before) // REPEATS
        assert all(o == base[0] for o in outs), "kvcanary changed the generated tokens"
        assert handle.total_violations == 0 and handle.errors == []
        med = statistics.median(times)
        results[f"fingerprint_{fp}"] = {
            "canary_s": med, "forwards": forwards,
            "overhead_ms_per_step": 1e3 * (med - results["baseline_s"]) / forwards,
            "baseline_ms_per_step": 1e3 * results["baseline_s"] / forwards,
            "prefix_hit_tokens": handle.stats["prefix_hit_tokens"]}
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
    assert {v.tag for v in vs} == {LaunchTag.TAIL_V_FULL}
    assert all(v.reasons == FailReason.VERIFY_FINGERPRINT for v in vs)
