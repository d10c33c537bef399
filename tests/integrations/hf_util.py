"""Shared helpers of the transformers integration tests: tiny random models, prompts, runs, fault hooks."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
if transformers.__version__ != "5.23.0":
    pytest.skip(f"kvcanary's transformers integration is pinned to 5.23.0, found {transformers.__version__}",
                allow_module_level=True)

import torch  # noqa: E402
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402

PAGE = 16
NO_EOS = {"eos_token_id": -1, "pad_token_id": 0}


def tiny_llama(device: str = "cpu", dtype: torch.dtype = torch.float32, **over: Any) -> Any:
    """A 2-layer random Llama (hidden 64, 4 q heads, 2 kv heads, vocab 256), sdpa attention, eval mode."""
    torch.manual_seed(0)
    kw: dict[str, Any] = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
                          "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    kw.update(over)
    model = LlamaForCausalLM(LlamaConfig(**kw)).eval().to(device=device, dtype=dtype)
    model.set_attn_implementation("sdpa")
    return model


def tiny_qwen3(device: str = "cpu", sliding_window: int = 0) -> Any:
    """A 2-layer random Qwen3, sdpa attention; full attention only unless ``sliding_window`` (then layer 0 slides)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    swa: dict[str, Any] = {"use_sliding_window": False}
    if sliding_window:
        swa = {"use_sliding_window": True, "sliding_window": sliding_window,
               "layer_types": ["sliding_attention", "full_attention"]}
    cfg = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None, **swa)
    model = Qwen3ForCausalLM(cfg).eval().to(device)
    model.set_attn_implementation("sdpa")
    return model


def shared_prefix_prompts(prefix_len: int = 40, tails: Sequence[int] = (5, 9, 17, 3), seed: int = 1) -> list[list[int]]:
    """Prompts sharing a ``prefix_len``-token prefix (so full blocks are shared, hit and de-duplicated)."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(1, 256, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(1, 256, (k,), generator=g).tolist() for k in tails]


def distinct_prompts(lengths: Sequence[int] = (45, 50), seed: int = 7) -> list[list[int]]:
    """Prompts with different first tokens (no block in common)."""
    g = torch.Generator().manual_seed(seed)
    return [[i + 1] + torch.randint(1, 256, (n - 1,), generator=g).tolist() for i, n in enumerate(lengths)]


def cb_config(max_batch_tokens: int = 256, num_blocks: int = 64, **over: Any) -> Any:
    """Continuous batching on the sdpa paged cache: no graphs, no async, no flash switch, no block-table path."""
    kw: dict[str, Any] = {"page_size": PAGE, "num_blocks": num_blocks, "max_batch_tokens": max_batch_tokens,
                          "allow_block_sharing": True, "use_cuda_graph": False, "use_async_batching": False,
                          "auto_switch_to_flash": False, "max_blocks_per_request": 0}
    kw.update(over)
    return ContinuousBatchingConfig(**kw)


def gen_config(max_new_tokens: int = 8, **over: Any) -> Any:
    """Greedy generation without EOS."""
    return GenerationConfig(max_new_tokens=max_new_tokens, **{"do_sample": False, **NO_EOS, **over})


def generate(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int = 8,
             max_batch_tokens: int = 256, **gen_over: Any) -> list[list[int]]:
    """generate_batch, tokens in input order."""
    out = model.generate_batch([list(p) for p in prompts], generation_config=gen_config(max_new_tokens, **gen_over),
                               continuous_batching_config=cb_config(max_batch_tokens), warmup=False)
    return [r.generated_tokens for r in out.values()]


Inject = Callable[[Any], None]


def run_manager(model: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 6,
                max_batch_tokens: int = 256, inject: Inject | None = None, sequential: bool = False,
                between: Callable[[Any, int], None] | None = None, timeout: float = 60.0) -> dict[str, list[int]]:
    """Run prompts through a ContinuousBatchingManager of ``model`` (ids r0, r1, ...).

    ``inject(batch_processor)`` runs after the processor exists (kvcanary attached) and before the loop starts;
    ``sequential`` waits for each request before adding the next, calling ``between(manager, i)`` after request i.
    """
    mgr = model.init_continuous_batching(generation_config=gen_config(max_new_tokens),
                                         continuous_batching_config=cb_config(max_batch_tokens))
    mgr.warmup()  # creates the batch processor (no graphs: nothing is captured)
    if inject is not None:
        inject(mgr.batch_processor)
    results: dict[str, list[int]] = {}
    try:
        if not sequential:
            for i, p in enumerate(prompts):
                mgr.add_request(list(p), request_id=f"r{i}", max_new_tokens=max_new_tokens)
        mgr.start()
        for i, p in enumerate(prompts):
            if sequential:
                mgr.add_request(list(p), request_id=f"r{i}", max_new_tokens=max_new_tokens)
                r = mgr.get_result(request_id=f"r{i}", timeout=timeout)
                assert r is not None and r.error is None, r
                results[r.request_id] = r.generated_tokens
                if between is not None:
                    between(mgr, i)
        while not sequential and len(results) < len(prompts):
            r = mgr.get_result(timeout=timeout)
            assert r is not None, "no result"
            assert r.error is None, r.error
            if r.is_finished():
                results[r.request_id] = r.generated_tokens
    finally:
        mgr.stop(block=True)
        mgr.destroy()
    return results


def wrap_instance(obj: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Test-side fault hook on top of whatever ``obj.name`` is now (removed by the integration's uninstall)."""
    setattr(obj, name, make(getattr(obj, name)))


def full_alloc(proc: Any) -> Any:
    """The full-attention allocator of a batch processor's cache."""
    return proc.cache.cache_allocators["full_attention"]
