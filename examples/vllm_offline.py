"""kvcanary guarding vLLM's KV cache in an offline LLM (vLLM 0.32 CPU build): one kv_transfer_config line.

    .venv-vllm/bin/python examples/vllm_offline.py [model_dir]

Without a model directory it saves a tiny randomly initialised Llama to a temporary directory (no download).
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process: the summary below reads it


def tiny_model() -> str:
    """A random 2-layer Llama (head size 32, 2 KV heads) saved with save_pretrained."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tempfile.mkdtemp(prefix="tiny-llama-")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).to(torch.bfloat16).save_pretrained(path)
    return path


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    model = sys.argv[1] if len(sys.argv) > 1 else tiny_model()
    # float32: with bf16, an AMX CPU runs CPU_ATTN kernels whose KV layout no fingerprint can read (docs/vllm.md)
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", max_model_len=512, block_size=32,
              enable_prefix_caching=True, enforce_eager=True, gpu_memory_utilization=0.3,
              kv_transfer_config=KVTransferConfig(
                  kv_connector="KVCanaryConnector", kv_connector_module_path="kvcanary.integrations.vllm",
                  kv_role="kv_both", kv_connector_extra_config={"mode": "log", "fingerprint": "all"}))
    shared = list(range(1, 80))
    prompts = [{"prompt_token_ids": shared + [100 + i] * (5 + i)} for i in range(8)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, detokenize=False))
    for o in outs:
        print(o.request_id, list(o.outputs[0].token_ids))
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().worker  # the worker-side connector (in-process engine core)
    print(f"kvcanary: {worker.canary.forwards} forwards guarded, {sum(r.total for r in worker.reports)} violations")


if __name__ == "__main__":
    main()
