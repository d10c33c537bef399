#!/usr/bin/env bash
# Host A/B in many short alternating rounds (a shared GPU host drifts by 2x between runs a minute apart, so one long run
# per side says little): A = an earlier commit's python/ on its wheel's native library (.ab/srcA, .ab/wheelA, as in
# gpu/run_begin_ab.sh), B = this tree's python/ on .whl's library; ROUNDS x (A, B) of bench_runtime at bs 1/64/256 (no
# engine row), then each side's reference-engine row ENGINE_ROUNDS times (A, B alternating), B's cProfile at bs 1 and
# B's CUDA demo. Summary: per row
# and side, the median and the best of the rounds (bench/summarize_rounds.py). Files in $OUT: rounds_log.txt
# rounds.tar.gz (every JSON) summary.md profile_B.txt demo_cuda.json. Carry .whl and .ab.
# Usage (repo root): [ROUNDS=6] [ITERS=500] [ENGINE_ROUNDS=1] bash gpu/run_rounds_ab.sh
set -o pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/rounds
source gpu/ab_common.sh
side_env() {  # side_env ROOT SITE: ROOT's Python and this tree's bench, SITE's native library, tvm-ffi from /tmp/site
  export PYTHONPATH=$1/python:$1/generated/python:/tmp/site:$PWD KVCANARY_NATIVE_DIR=$2/kvcanary/_lib
}
side() {  # side A|B
  if [ "$1" = A ]; then side_env "$PWD/.ab/srcA" /tmp/siteA; else side_env "$PWD" /tmp/site; fi
}
{
  ab_install || exit 1
  for run in $(seq "${ROUNDS:-6}"); do
    for s in A B; do
      echo "=== round $run $s $(date -u +%T)"
      side $s
      timeout 120 python3 -m bench.bench_runtime --device cuda --backends cuda --bs 1,64,256 --iters "${ITERS:-500}" \
        --config default --engine-steps 0 --out "/tmp/rounds/runtime_${s}_$run.json" | grep -E "replay|eager"
    done
  done
  for run in $(seq "${ENGINE_ROUNDS:-1}"); do
    for s in A B; do
      echo "=== engine $s $run $(date -u +%T)"
      side $s
      timeout 150 python3 -m bench.bench_runtime --device cuda --backends cuda --bs 1 --iters 10 --config default \
        --engine-steps 100 --out "/tmp/rounds/engine_${s}_$run.json" | grep -E "engine"
    done
  done
  side B
  echo "=== profile B $(date -u +%T)"
  timeout 120 python3 -m bench.bench_runtime --device cuda --backends cuda --bs 1 --iters 2000 --config default \
    --engine-steps 0 --profile "$OUT/profile_B.txt" > /dev/null
  echo "=== demo B $(date -u +%T)"
  timeout 120 python3 -m kvcanary demo --device cuda --json > "$OUT/demo_cuda.json"; echo "demo rc=$?"
  python3 -m bench.summarize_rounds /tmp/rounds > "$OUT/summary.md"; cat "$OUT/summary.md"
  tar -czf "$OUT/rounds.tar.gz" -C /tmp rounds
  ab_done
} 2>&1 | tee "$OUT/rounds_log.txt"
