#!/usr/bin/env bash
# Reference-engine row A/B for a Python-only change: A = an earlier commit's python/ and bench/ (.ab/srcA, from
# `git archive <commit> python generated/python bench | tar -x -C .ab/srcA`), B = this tree, both on this tree's native
# library (.whl), alternating A B A B in one job: this tree's bench_runtime (engine row cold and warm), then B's engine
# profile (split of the
# export), the CUDA demo JSON and the GPU tests of tests/engine and tests/e2e (`all`: every GPU test but disagg's).
# Files in $OUT: ab_log.txt runtime_{A,B}{1,2}.json profile_engine_B.txt demo_cuda.json junit.xml.
# Carry .whl and .ab/srcA (and .hfproto, whose transformers wheels the transformers GPU tests need).
# Usage (repo root): bash gpu/run_engine_ab.sh [all]
set -o pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
side_env() {  # side_env ROOT: PYTHONPATH on ROOT's Python and this tree's bench, the installed wheel's native library
  export PYTHONPATH=$1/python:$1/generated/python:/tmp/site:$PWD KVCANARY_NATIVE_DIR=/tmp/site/kvcanary/_lib
}
{
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    $(ls .hfproto/wheels/*.whl 2>/dev/null) \
    || exit 1
  export PYTHONUNBUFFERED=1 KVCANARY_CACHE_DIR=/tmp/kvcanary-jit
  nvidia-smi --query-gpu=name --format=csv,noheader
  for run in 1 2; do
    for side in A B; do
      echo "=== engine row $side$run $(date -u +%T)"
      root=$PWD; [ $side = A ] && root=$PWD/.ab/srcA
      (side_env "$root"; timeout 200 python3 -m bench.bench_runtime --device cuda --backends cuda \
        --bs 1,64 --iters 300 --config default --engine-steps 100 --out "$OUT/runtime_$side$run.json" | tail -8)
    done
  done
  side_env "$PWD"
  echo "=== profile_engine B $(date -u +%T)"
  timeout 200 python3 -m bench.profile_engine --device cuda --steps 100 --out "$OUT/profile_engine_B.txt"
  head -4 "$OUT/profile_engine_B.txt"
  echo "=== demo B $(date -u +%T)"
  timeout 200 python3 -m kvcanary demo --device cuda --json > "$OUT/demo_cuda.json"; echo "demo rc=$?"
  where="tests/engine tests/e2e"; [ "${1:-}" = all ] && where="tests --ignore=tests/disagg"
  echo "=== gpu tests B ($where) $(date -u +%T)"
  timeout 300 python3 -m pytest -q -m gpu $where -p no:cacheprovider --tb=short --maxfail=20 \
    --junitxml="$OUT/junit.xml" -o junit_family=xunit2 2>&1 | tail -8
  echo "=== done $(date -u +%T)"
} 2>&1 | tee "$OUT/ab_log.txt"
