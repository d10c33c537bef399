"""Shared helpers of the vLLM connector tests: a tiny random Llama, engines with and without kvcanary, fault hooks."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in-process: tests reach its objects

BLOCK = 32
CONNECTOR = {"kv_connector": "KVCanaryConnector", "kv_connector_module_path": "kvcanary.integrations.vllm",
             "kv_role": "kv_both"}


def tiny_llama(path: Path, layers: int = 2, seed: int = 0) -> str:
    """A randomly initialised Llama saved with save_pretrained (no download); head size 32, 2 KV heads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return str(path)


def make_llm(model: str, extra: dict[str, Any] | None = None, *, connector: bool = True, blocks: int = 64,
             max_tokens: int = 128, **kw: Any) -> Any:
    """An offline engine: prefix caching, chunked prefill with a small token budget, a small KV cache (preemption)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    args: dict[str, Any] = dict(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512,
                                enable_prefix_caching=True, block_size=BLOCK, enforce_eager=True,
                                gpu_memory_utilization=0.3, num_gpu_blocks_override=blocks,
                                max_num_batched_tokens=max_tokens, enable_chunked_prefill=True, max_num_seqs=16)
    if connector:
        args["kv_transfer_config"] = KVTransferConfig(**CONNECTOR, kv_connector_extra_config=extra or {})
    args.update(kw)
    return LLM(**args)


def core(llm: Any) -> Any:
    """The in-process EngineCore."""
    return llm.llm_engine.engine_core.engine_core


def connectors(llm: Any) -> tuple[Any, Any]:
    """(scheduler-side, worker-side) KVCanaryConnector of an in-process engine."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return core(llm).scheduler.connector, get_kv_transfer_group()


def prompts(rng: random.Random, n: int, shared: list[int] | None = None, lo: int = 8, hi: int = 200) -> list[dict[str, Any]]:
    """Token-id prompts (optionally sharing a prefix)."""
    out = []
    for _ in range(n):
        body = [rng.randrange(1, 500) for _ in range(rng.randint(lo, hi))]
        out.append({"prompt_token_ids": (shared or []) + body})
    return out
