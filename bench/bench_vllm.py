"""vLLM CPU step time and tokens/s with and without the kvcanary connector, in the same run.

    .venv-vllm/bin/python -m bench.bench_vllm [--quick]

Writes bench/results/vllm_cpu.json and .md. Workloads: decode-heavy (short prompts, long outputs) and prefill-heavy
(long prompts sharing prefixes, short outputs), greedy. Each configuration runs in a fresh in-process engine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

REPEATS = 2
# float32: with bf16, an AMX CPU runs CPU_ATTN kernels whose KV layout no fingerprint can read (docs/vllm.md)
DTYPE = "float32"
OUT = Path(__file__).resolve().parent / "results"
CONNECTOR = {"kv_connector": "KVCanaryConnector", "kv_connector_module_path": "kvcanary.integrations.vllm",
             "kv_role": "kv_both"}
CONFIGS: dict[str, dict[str, Any] | None] = {
    "vllm": None,
    "kvcanary defaults (CanaryConfig(): auto backend, default detection policy)": {"stats_interval": 0},
    "kvcanary backend=cpu, fingerprint=all, all layers": {"backend": "cpu", "fingerprint": "all",
                                                          "layer_coverage": "all", "stats_interval": 0},
}


def model(path: str) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                                 num_attention_heads=8, num_key_value_heads=4)).to(torch.bfloat16).save_pretrained(path)
    return path


def workload(kind: str, n: int) -> list[tuple[list[int], int]]:
    rng = random.Random(0)
    if kind == "decode":
        return [([rng.randrange(1, 4000) for _ in range(rng.randint(16, 48))], 96) for _ in range(n)]
    shared = [[rng.randrange(1, 4000) for _ in range(256)] for _ in range(4)]
    return [(shared[i % 4] + [rng.randrange(1, 4000) for _ in range(rng.randint(128, 480))], 4) for i in range(n)]


def run(path: str, extra: dict[str, Any] | None, reqs: list[tuple[list[int], int]]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    kw: dict[str, Any] = {}
    if extra is not None:
        kw["kv_transfer_config"] = KVTransferConfig(**CONNECTOR, kv_connector_extra_config=extra)
    llm = LLM(model=path, skip_tokenizer_init=True, dtype=DTYPE, max_model_len=1024, block_size=32,
              enable_prefix_caching=True, enforce_eager=True, gpu_memory_utilization=0.3, num_gpu_blocks_override=1024,
              max_num_batched_tokens=512, max_num_seqs=32, **kw)
    try:
        eng = llm.llm_engine
        for i, (p, m) in enumerate(reqs):
            eng.add_request(str(i), {"prompt_token_ids": p},
                            SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, detokenize=False))
        steps: list[float] = []
        t_all = time.perf_counter()
        while eng.has_unfinished_requests():
            t0 = time.perf_counter()
            eng.step()
            steps.append(time.perf_counter() - t0)
        wall = time.perf_counter() - t_all
        tokens = sum(len(p) + m for p, m in reqs)
        out = {"steps": len(steps), "wall_s": wall, "step_ms_median": 1e3 * statistics.median(steps),
               "step_ms_mean": 1e3 * wall / len(steps), "tokens_per_s": tokens / wall,
               "generated_tokens_per_s": sum(m for _, m in reqs) / wall}
        if extra is not None:
            w = get_kv_transfer_group().worker
            out["canary_host_us_per_step"] = w.host_us_total / max(1, w.canary.forwards)
            out["violations"] = sum(r.total for r in w.reports)
        return out
    finally:
        eng.engine_core.shutdown()
        ensure_kv_transfer_shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    import vllm

    path = model(tempfile.mkdtemp(prefix="bench-llama-"))
    sizes = {"decode": 16 if args.quick else 32, "prefill": 12 if args.quick else 24}
    results: dict[str, Any] = {"vllm": vllm.__version__, "torch": torch.__version__, "machine": platform.processor()
                               or platform.machine(), "cpus": os.cpu_count(), "model": "Llama 4 layers, hidden 512, "
                               f"8 heads / 4 KV heads (head 64), {DTYPE}, block 32", "workloads": {}}
    for kind, n in sizes.items():
        reqs = workload(kind, n)
        # the machine is shared: configurations alternate, each runs REPEATS times, the fastest run of each is kept
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
        for _ in range(REPEATS):
            for name, extra in CONFIGS.items():
                runs[name].append(run(path, extra, reqs))
        rows = {name: min(rs, key=lambda r: r["wall_s"]) for name, rs in runs.items()}
        for name, rs in runs.items():
            rows[name]["wall_s_all_runs"] = [r["wall_s"] for r in rs]
        base = rows["vllm"]
        for r in rows.values():
            r["step_time_ratio"] = r["step_ms_mean"] / base["step_ms_mean"]
            r["tokens_per_s_ratio"] = r["tokens_per_s"] / base["tokens_per_s"]
        results["workloads"][kind] = {"requests": n, "configs": rows}
        print(kind, json.dumps(rows, indent=1))
    OUT.mkdir(exist_ok=True)
    (OUT / "vllm_cpu.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [f"# vLLM {results['vllm']} CPU with and without kvcanary", "",
             f"{results['model']}; {results['cpus']} CPUs (shared machine); eager; prefix caching; chunked prefill "
             "(512-token budget). Same process, fresh engine per run; configurations alternate, "
             f"{REPEATS} runs each, the fastest kept (the machine is shared with other jobs).", ""]
    for kind, w in results["workloads"].items():
        lines += [f"## {kind}-heavy ({w['requests']} requests)", "",
                  "| config | steps | step ms (mean) | step ms (median) | tokens/s | step-time ratio "
                  "| canary host µs/step |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for name, r in w["configs"].items():
            host = f"{r['canary_host_us_per_step']:.0f}" if "canary_host_us_per_step" in r else "–"
            lines.append(f"| {name} | {r['steps']} | {r['step_ms_mean']:.2f} | {r['step_ms_median']:.2f} | "
                         f"{r['tokens_per_s']:.0f} | {r['step_time_ratio']:.3f} | {host} |")
        lines.append("")
    (OUT / "vllm_cpu.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
