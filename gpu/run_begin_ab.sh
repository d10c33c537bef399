#!/usr/bin/env bash
# Host A/B of a change to Python and native code on one GPU machine: A = an earlier commit's python/ (.ab/srcA, from
# `git archive <commit> python generated/python bench | tar -x -C .ab/srcA`) on its own wheel's native library
# (.ab/wheelA), B = this tree's python/ on .whl's kvcanary wheel; A1 B1 A2 B2 of this tree's bench_runtime (eager and
# replay at bs 1/64/256, the reference engine cold and warm), then B's CUDA demo. Files in $OUT: ab_log.txt
# runtime_{A,B}{1,2}.json demo_cuda.json. Carry .whl and .ab. Usage (repo root): [ITERS=300] bash gpu/run_begin_ab.sh
set -o pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source gpu/ab_common.sh
side_env() {  # side_env ROOT SITE: ROOT's Python and this tree's bench, SITE's native library, tvm-ffi from /tmp/site
  export PYTHONPATH=$1/python:$1/generated/python:/tmp/site:$PWD KVCANARY_NATIVE_DIR=$2/kvcanary/_lib
}
{
  ab_install || exit 1
  for run in 1 2; do
    for side in A B; do
      echo "=== bench_runtime $side$run $(date -u +%T)"
      if [ $side = A ]; then side_env "$PWD/.ab/srcA" /tmp/siteA; else side_env "$PWD" /tmp/site; fi
      timeout 150 python3 -m bench.bench_runtime --device cuda --backends cuda --bs 1,64,256 --iters "${ITERS:-300}" \
        --config default --engine-steps 100 --out "$OUT/runtime_$side$run.json" | tail -12
    done
  done
  side_env "$PWD" /tmp/site
  echo "=== demo B $(date -u +%T)"
  timeout 120 python3 -m kvcanary demo --device cuda --json > "$OUT/demo_cuda.json"; echo "demo rc=$?"
  ab_done
} 2>&1 | tee "$OUT/ab_log.txt"
