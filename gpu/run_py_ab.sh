#!/usr/bin/env bash
# Host A/B on natives JIT-built on the machine (no kvcanary wheel): A = .ab/srcA (an earlier commit's python/,
# generated/ and csrc/: git archive REV python generated csrc | tar -x -C .ab/srcA), B = this tree. ENGINE_ROUNDS x
# (A, B) of the reference-engine row, ROUNDS x (A, B) of the bracket rows at batch sizes BS (default 1,64,256; ROUNDS
# 0: none), then B's hook probe (gpu/probe_hook_times.py cuda) and B's GPU tests under TESTS (pytest paths; none when
# empty). Summary: per row and side the median and the best of the rounds (bench/summarize_rounds.py). Files in $OUT:
# log.txt rounds.tar.gz summary.md. Carry .whl (tvm-ffi) and .ab (and .hfproto for the transformers tests).
# PIN: a command prefix for every timed process, e.g. PIN="taskset -c 5" (the host's speed is bimodal per process
# unpinned). Usage: [ROUNDS=0] [ENGINE_ROUNDS=4] [BS=1,64,256] [TESTS=...] [PIN=...] bash gpu/run_py_ab.sh
set -o pipefail
OUT=${OUT:-/tmp/out}
rm -rf /tmp/rounds  # a warm machine keeps an earlier call's rounds: summarize only this call's
mkdir -p "$OUT" /tmp/rounds
side() {  # side A|B: that side's sources, each with its own JIT cache
  local root=$PWD
  [ "$1" = B ] || root=$PWD/.ab/srcA
  export PYTHONPATH=$root/python:$root/generated/python:/tmp/site:$PWD KVCANARY_CACHE_DIR=/tmp/kvc-jit-$1
}
{
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl $(ls .hfproto/wheels/*.whl 2>/dev/null) || exit 1
  export PYTHONUNBUFFERED=1 TVM_FFI_CUDA_ARCH_LIST=9.0a
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
  lscpu | grep -E "Model name|NUMA|^CPU\(s\)|MHz"; echo "PIN=${PIN:-none}"
  for s in A B; do side $s; python3 -c "from kvcanary import _native as n; print('$s', n.load('cuda').origin, \
    n.load('cpu').origin)" || exit 1; done
  for run in $(seq "${ENGINE_ROUNDS:-4}"); do
    for s in A B; do
      echo "=== engine $s $run $(date -u +%T)"; side $s
      timeout 150 $PIN python3 -m bench.bench_runtime --device cuda --backends cuda --bs 1 --iters 10 --config default \
        --engine-steps 100 --out "/tmp/rounds/engine_${s}_$run.json" | grep -E "engine"
    done
  done
  for run in $(seq "${ROUNDS:-0}"); do
    for s in A B; do
      echo "=== round $run $s $(date -u +%T)"; side $s
      timeout 120 $PIN python3 -m bench.bench_runtime --device cuda --backends cuda --bs "${BS:-1,64,256}" --iters 500 \
        --config default --engine-steps 0 --out "/tmp/rounds/runtime_${s}_$run.json" | grep -E "replay|eager"
    done
  done
  side B
  echo "=== hook probe B $(date -u +%T)"
  timeout 120 $PIN python3 gpu/probe_hook_times.py cuda
  [ -z "${TESTS:-}" ] || { echo "=== gpu tests B $(date -u +%T)"
    timeout 300 python3 -m pytest -q -m gpu $TESTS -p no:cacheprovider --tb=short > /tmp/gpu_tests.log 2>&1
    echo "gpu tests rc=$?"; grep -E "passed|failed|error" /tmp/gpu_tests.log | tail -15; }
  python3 -m bench.summarize_rounds /tmp/rounds > "$OUT/summary.md"; cat "$OUT/summary.md"
  tar -czf "$OUT/rounds.tar.gz" -C /tmp rounds
  echo "=== done $(date -u +%T)"
} 2>&1 | tee "$OUT/log.txt"
