#!/usr/bin/env bash
# Host-path A/B on one GPU machine: bench_runtime (eager and graph replay, CanaryConfig(), the reference engine) for
# an earlier commit A and this tree B, alternating A B A B in one job, each on its own installed wheel (the same
# bench_runtime.py for both, from this tree), then the GPU test suite on B. Files in $OUT: ab_log.txt
# runtime_{A,B}{1,2}.json junit.xml.
# A: `git worktree add /tmp/A <commit> && pip wheel --no-deps -w .ab/wheelA /tmp/A` (carry .ab and .whl).
# Needs .whl with the tvm-ffi wheel and this tree's kvcanary wheel. Usage (repo root): [BENCH_ARGS="--req-capacity 256"]
# bash gpu/run_host_ab.sh [tests]
set -o pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
{
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/siteA \
    .ab/wheelA/*.whl || exit 1
  export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 KVCANARY_CACHE_DIR=/tmp/kvcanary-jit
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
  BENCH="python3 -m bench.bench_runtime --device cuda --backends cuda --iters 300 --config default --engine-steps 100 ${BENCH_ARGS:-}"
  for run in 1 2; do
    for side in A B; do
      echo "=== bench_runtime $side$run $(date -u +%T)"
      site=/tmp/site
      [ $side = A ] && site=/tmp/siteA:/tmp/site
      PYTHONPATH=$site:$PWD timeout 150 $BENCH --out "$OUT/runtime_$side$run.json" | tail -12
    done
  done
  if [ "${1:-}" = tests ]; then
    echo "=== gpu tests (B) $(date -u +%T)"
    PYTHONPATH=/tmp/site:$PWD timeout 260 python3 -m pytest -q -m gpu tests --ignore=tests/disagg -p no:cacheprovider \
      --tb=short --maxfail=20 --junitxml="$OUT/junit.xml" -o junit_family=xunit2 2>&1 | tail -25
  fi
  echo "=== JIT builds during the run: $(find /tmp/kvcanary-jit -name '*.so' 2>/dev/null | wc -l) (0 expected)"
  echo "=== done $(date -u +%T)"
} 2>&1 | tee "$OUT/ab_log.txt"
