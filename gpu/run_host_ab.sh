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
source gpu/ab_common.sh
BENCH="python3 -m bench.bench_runtime --device cuda --backends cuda --iters 300 --config default --engine-steps 100"
one_run() { timeout 150 $BENCH ${BENCH_ARGS:-} --out "$OUT/runtime_$1.json" | tail -12; }
{
  ab_install || exit 1
  ab_runs bench_runtime one_run
  if [ "${1:-}" = tests ]; then
    echo "=== gpu tests (B) $(date -u +%T)"
    PYTHONPATH=/tmp/site:$PWD timeout 260 python3 -m pytest -q -m gpu tests --ignore=tests/disagg -p no:cacheprovider \
      --tb=short --maxfail=20 --junitxml="$OUT/junit.xml" -o junit_family=xunit2 2>&1 | tail -25
  fi
  ab_done
} 2>&1 | tee "$OUT/ab_log.txt"
