#!/usr/bin/env bash
# transformers A/B on natives JIT-built on the machine: A = .ab/srcA (an earlier commit's python/, generated/ and
# csrc/: git archive REV python generated csrc | tar -x -C .ab/srcA), B = this tree. B's transformers GPU tests unless
# NO_TESTS, then ROUNDS x (A, B) of gpu/probe_tf_parts.py (the bracket's parts per generation step, 1.1 B Llama, bs 32,
# prompt 1024), then B's bench_transformers row unless NO_BENCH (steady state, the configs side by side, their loops
# pinned by the bench itself to core 4). Files in $OUT: log.txt tf_bench.json. Carry .whl (tvm-ffi) .ab .hfproto.
# PIN: a command prefix for the probe's processes. ROUNDS=0: no A side (no .ab/srcA needed), B's tests and bench only.
# The probe's own variables pass through (DEEP=1 NEW=41: its parts inside the batch view and the slice, the bench's
# token count); BENCH_ARGS: more bench_transformers arguments (e.g. "--control --repeats 3"; later ones win).
# Usage: [ROUNDS=2] [NO_TESTS=1] [NO_BENCH=1] [PIN="taskset -c 4"] [DEEP=1 NEW=41] [BENCH_ARGS=...] bash gpu/run_tf_ab.sh
set -o pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
side() {  # side A|B: that side's Python sources
  local root=$PWD
  [ "$1" = B ] || root=$PWD/.ab/srcA
  export PYTHONPATH=$root/python:$root/generated/python:/tmp/site:$PWD
}
{
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl $(ls .hfproto/wheels/*.whl 2>/dev/null) || exit 1
  export PYTHONUNBUFFERED=1 TVM_FFI_CUDA_ARCH_LIST=9.0a HF_HUB_OFFLINE=1 KVCANARY_CACHE_DIR=/tmp/kvc-jit-tf
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
  echo "PIN=${PIN:-none}"
  # each side's JIT build before any timed run (the cache is per source tree: a build inside a timed run is killed
  # by its timeout and starts over in the next)
  sides="A B"
  [ "${ROUNDS:-2}" != 0 ] || sides=B
  for s in $sides; do side $s; python3 -c "from kvcanary import _native as n; print('$s', n.load('cuda').origin, \
    n.load('cpu').origin)" || exit 1; done
  [ -n "${NO_TESTS:-}" ] || { echo "=== transformers gpu tests B $(date -u +%T)"
    timeout 200 python3 -m pytest -q -m gpu tests/integrations/test_transformers_gpu.py -p no:cacheprovider \
      --tb=short 2>&1 | tail -8; }
  for run in $(seq "${ROUNDS:-2}"); do
    for s in A B; do
      echo "=== tf parts $s$run $(date -u +%T)"; side $s
      timeout 100 $PIN python3 gpu/probe_tf_parts.py cuda 1b 32 1024 2>&1 | grep -v Logger
    done
  done
  side B
  [ -n "${NO_BENCH:-}" ] || { echo "=== bench_transformers B $(date -u +%T)"
    timeout 420 python3 -m bench.bench_transformers --device cuda --model 1b --batch 32 --prompt 1024 \
      --new-tokens 41 --skip-decode 16 --repeats 4 --loop-cpu 4 --out "$OUT/tf_bench.json" ${BENCH_ARGS:-} 2>&1 \
      | grep -v Logger; }
  echo "=== done $(date -u +%T)"
} 2>&1 | tee "$OUT/log.txt"
