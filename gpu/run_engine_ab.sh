#!/usr/bin/env bash
# Reference-engine row A/B of two Python trees on natives JIT-built on the machine: A = .ab/srcA (`git archive REV
# python generated bench csrc | tar -x -C .ab/srcA`), B = $B_ROOT (default this tree; e.g. .ab/srcB, made the same
# way from a branch), ROUNDS x (A, B) alternating in one job of this tree's bench_runtime (engine row and the bracket
# rows at bs 1, 64). Unless ENGINE_ONLY: then B's engine profile (split of the export), the CUDA demo JSON and the GPU
# tests of tests/engine and tests/e2e (`all`: every GPU test but disagg's).
# Files in $OUT: ab_log.txt runtime_{A,B}N.json [profile_engine_B.txt demo_cuda.json junit.xml].
# Carry .whl (tvm-ffi) and .ab (and .hfproto, whose transformers wheels the transformers GPU tests need).
# Usage (repo root): [ROUNDS=2] [B_ROOT=.ab/srcB] [ENGINE_ONLY=1] bash gpu/run_engine_ab.sh [all]
set -o pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
B_ROOT=$(cd "${B_ROOT:-.}" && pwd)
side() {  # side A|B: that side's Python sources, this tree's bench
  local root=$B_ROOT
  [ "$1" = B ] || root=$PWD/.ab/srcA
  export PYTHONPATH=$root/python:$root/generated/python:/tmp/site:$PWD
}
{
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    $(ls .hfproto/wheels/*.whl 2>/dev/null) \
    || exit 1
  export PYTHONUNBUFFERED=1 TVM_FFI_CUDA_ARCH_LIST=9.0a HF_HUB_OFFLINE=1 KVCANARY_CACHE_DIR=/tmp/kvc-jit-engine
  nvidia-smi --query-gpu=name --format=csv,noheader
  # each side's JIT build before any timed run (the cache is per source tree)
  for s in A B; do side $s; python3 -c "from kvcanary import _native as n; print('$s', n.load('cuda').origin, \
    n.load('cpu').origin)" || exit 1; done
  for run in $(seq "${ROUNDS:-2}"); do
    for s in A B; do
      echo "=== engine row $s$run $(date -u +%T)"; side $s
      timeout 200 python3 -m bench.bench_runtime --device cuda --backends cuda \
        --bs 1,64 --iters 300 --config default --engine-steps 100 --out "$OUT/runtime_$s$run.json" | tail -8
    done
  done
  side B
  [ -n "${ENGINE_ONLY:-}" ] || {
    echo "=== profile_engine B $(date -u +%T)"
    timeout 200 python3 -m bench.profile_engine --device cuda --steps 100 --out "$OUT/profile_engine_B.txt"
    head -4 "$OUT/profile_engine_B.txt"
    echo "=== demo B $(date -u +%T)"
    timeout 200 python3 -m kvcanary demo --device cuda --json > "$OUT/demo_cuda.json"; echo "demo rc=$?"
    where="tests/engine tests/e2e"; [ "${1:-}" = all ] && where="tests --ignore=tests/disagg"
    echo "=== gpu tests B ($where) $(date -u +%T)"
    timeout 300 python3 -m pytest -q -m gpu $where -p no:cacheprovider --tb=short --maxfail=20 \
      --junitxml="$OUT/junit.xml" -o junit_family=xunit2 2>&1 | tail -8; }
  echo "=== done $(date -u +%T)"
} 2>&1 | tee "$OUT/ab_log.txt"
