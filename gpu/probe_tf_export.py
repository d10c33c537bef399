"""Probe: the transformers adapter's prefix-cache export build measured alone (after a generate_batch, in the main
thread, nothing else running), against what the in-CB probes charge to it. Usage: python3 gpu/probe_tf_export.py
[cuda|cpu] [1b|tiny] [batch] [prompt]."""

import statistics
import sys
import time
from typing import Any

import kvcanary.integrations.transformers as kt
import torch
from kvcanary.config import CanaryConfig

from bench.bench_transformers import LLAMA_1B, LLAMA_TINY, StepTimer, build_model, prompts, run_once

device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
cfg = LLAMA_1B if (sys.argv[2] if len(sys.argv) > 2 else "1b") == "1b" else LLAMA_TINY
batch, prompt = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (32, 1024)
adapters: list[kt.HFPoolAdapter] = []
init = kt.HFPoolAdapter.__init__


def keep(self: kt.HFPoolAdapter, *a: Any, **k: Any) -> None:
    init(self, *a, **k)
    adapters.append(self)


kt.HFPoolAdapter.__init__ = keep  # type: ignore[method-assign]
model = build_model(cfg, device, torch.bfloat16 if device == "cuda" else torch.float32)
with StepTimer(device) as timer:
    handle = kt.install(model, CanaryConfig(mode="raise"))
    try:
        run_once(model, prompts(batch, prompt, cfg["vocab_size"]), 17, timer)
    finally:
        handle.uninstall()
a = adapters[-1]
ts = []
for _ in range(50):
    t = time.perf_counter()
    e = a._build_export()
    if device == "cuda":
        torch.cuda.synchronize()
    ts.append(time.perf_counter() - t)
print(f"{device} batch {batch} prompt {prompt}: {e.num_chains} chains, export build alone median "
      f"{1e6 * statistics.median(ts):.1f} us (with the copy synchronized)")
