#!/usr/bin/env bash
# Issue 13/14 performance rows on one GPU, on the installed wheel: the host bracket (bench_runtime, eager and graph
# replay, defaults and minimal config), transformers continuous batching with a ~1B Llama (bench_transformers), and
# the default-policy rows of bench_gpu. Files in $OUT: perf_log.txt runtime_cuda.json transformers_gpu_1b.json
# policy.{json,md}. Needs .whl (tvm-ffi + kvcanary wheels) and .hfproto/wheels (transformers). Usage: bash gpu/run_perf.sh
set -o pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
{
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl $(ls .hfproto/wheels/*.whl 2>/dev/null) || exit 1
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 KVCANARY_CACHE_DIR=/tmp/kvcanary-jit
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
  echo "=== bench_runtime $(date -u +%T)"
  timeout 200 python3 -m bench.bench_runtime --device cuda --backends cuda --iters 200 --out "$OUT/runtime_cuda.json" \
    | tail -30
  echo "=== bench_gpu policy rows $(date -u +%T)"
  timeout 150 python3 -m bench.bench_gpu --samples 20 --out /tmp/policy --only "policy base,fp default" | tail -25
  for f in /tmp/policy/*.json /tmp/policy/*.md; do cp "$f" "$OUT/policy.${f##*.}"; done
  echo "=== bench_transformers 1B $(date -u +%T)"
  timeout 240 python3 -m bench.bench_transformers --device cuda --model 1b --batch 32 --prompt 1024 --new-tokens 33 \
    --repeats 3 --out "$OUT/transformers_gpu_1b.json" 2>&1 | grep -v Logger | tail -8
  echo "=== done $(date -u +%T)"
} 2>&1 | tee "$OUT/perf_log.txt"
