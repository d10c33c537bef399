"""kvcanary in Hugging Face transformers continuous batching: the 5 lines, on a tiny random Llama (no downloads)."""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)).eval().to(device)
prefix = torch.randint(1, 256, (40,)).tolist()
prompts = [prefix + torch.randint(1, 256, (n,)).tolist() for n in (5, 9, 17, 3)]

# ---- the 5 lines -------------------------------------------------------------------------------------------------
from kvcanary.config import CanaryConfig  # noqa: E402
from kvcanary.integrations.transformers import install  # noqa: E402

model.set_attn_implementation("sdpa")  # the paged sdpa cache: every KV write goes through a wrapped choke point
cb = ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=24, auto_switch_to_flash=False)
with install(model, CanaryConfig(mode="raise", fingerprint="all")) as canary:
    out = model.generate_batch(prompts, generation_config=GenerationConfig(max_new_tokens=8, do_sample=False,
                               eos_token_id=-1), continuous_batching_config=cb, warmup=False)
# -------------------------------------------------------------------------------------------------------------------

print(f"{len(out)} requests, {canary.stats['forwards']} forwards, {canary.stats['prefix_hit_tokens']} prefix-hit "
      f"tokens, {canary.total_violations} violations")
for rid, r in out.items():
    print(rid, r.generated_tokens)
sys.exit(1 if canary.total_violations else 0)
