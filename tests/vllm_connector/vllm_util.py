"""Shared helpers of the vLLM connector tests: a tiny random Llama, engines with and without kvcanary, fault hooks."""

from __future__ import annotations

import os
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

    args: dict[str, Any] = dict(model=model, skip_tokenizer_init=True, dtype="float32", max_model_len=512,
                                enable_prefix_caching=True, block_size=BLOCK, enforce_eager=True,
                                gpu_memory_utilization=0.3, num_gpu_blocks_override=blocks,
                                max_num_batched_tokens=max_tokens, enable_chunked_prefill=True, max_num_seqs=8)
    if connector:
        args["kv_transfer_config"] = KVTransferConfig(**CONNECTOR, kv_connector_extra_config=extra or {})
    args.update(kw)
    return LLM(**args)


def core(llm: Any) -> Any:
    """The in-process EngineCore."""
    return llm.llm_engine.engine_core.engine_core


def connectors(llm: Any) -> tuple[Any, Any]:
    """(scheduler-side, worker-side) KVCanaryConnector of an in-process engine (also inside a MultiConnector)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    def canary(c: Any) -> Any:
        return next(x for x in getattr(c, "_connectors", [c]) if type(x).__name__ == "KVCanaryConnector")

    return canary(core(llm).scheduler.connector), canary(get_kv_transfer_group())


def close(llm: Any) -> None:
    """Shut an in-process engine down and drop vLLM's process-global connector (the next engine makes its own)."""
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    llm.llm_engine.engine_core.shutdown()
    ensure_kv_transfer_shutdown()


class Driver:
    """Steps an engine by hand (faults go between steps) and reads the canary's reports."""

    def __init__(self, llm: Any) -> None:
        self.llm, self.engine = llm, llm.llm_engine
        self.sched, self.conn = connectors(llm)
        self.worker = self.conn.worker
        self.runner = self.worker.runner
        self.pool = self.sched.sched.pool
        self.outputs: dict[str, list[int]] = {}
        self.mark = len(self.worker.reports)

    @property
    def forwards(self) -> int:
        """Forwards the canary bracketed so far."""
        return int(self.worker.canary.forwards)

    def add(self, rid: str, tokens: list[int], max_tokens: int = 16) -> None:
        from vllm import SamplingParams

        self.engine.add_request(rid, {"prompt_token_ids": tokens},
                                SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False))

    def step(self) -> None:
        for out in self.engine.step():
            if out.finished:
                self.outputs[out.request_id] = list(out.outputs[0].token_ids)

    def run(self, max_steps: int = 400) -> None:
        for _ in range(max_steps):
            if not self.engine.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("requests did not finish")

    def internal(self, ext: str) -> str:
        """vLLM's internal id (external id + random suffix) of a live request."""
        ids = [r for r in self.sched.sched.reqs if r.startswith(ext + "-")]
        assert len(ids) == 1, (ext, ids)
        return ids[0]

    def blocks(self, rid: str) -> list[int]:
        """The request's block ids (scheduler side)."""
        return list(self.sched.sched.manager.get_block_ids(rid)[0])

    def violations(self) -> list[Any]:
        """Violations reported since the last call."""
        reps = self.worker.reports[self.mark:]
        self.mark = len(self.worker.reports)
        return [v for r in reps for v in r.violations]
