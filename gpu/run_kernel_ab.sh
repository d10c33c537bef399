#!/usr/bin/env bash
# Kernel-path A/B on one GPU machine: bench_gpu --quick (the scenarios with absolute targets, CUDA graph replay) for an
# earlier commit A and this tree B, alternating A B A B in one job, each on its own installed wheel (the same
# bench_gpu.py for both, from this tree). Files in $OUT/kernel_ab: ab_log.txt gpu_{A,B}{1,2}.{json,md}.
# A: `git worktree add /tmp/A <commit> && pip wheel --no-deps -w .ab/wheelA /tmp/A` (carry .ab and .whl).
# Needs .whl with the tvm-ffi wheel and this tree's kvcanary wheel. Usage (repo root): bash gpu/run_kernel_ab.sh
set -o pipefail
OUT=${OUT:-/tmp/out}/kernel_ab
mkdir -p "$OUT"
source gpu/ab_common.sh
one_run() {
  timeout 150 python3 -m bench.bench_gpu --quick --samples 20 --out "/tmp/kab_$1" | grep -E "^\| (decode|extend|swa)" \
    | cut -d'|' -f2-4
  local f
  for f in /tmp/kab_$1/*.json /tmp/kab_$1/*.md; do cp "$f" "$OUT/gpu_$1.${f##*.}"; done
}
{
  ab_install || exit 1
  ab_runs bench_gpu one_run
  ab_done
} 2>&1 | tee "$OUT/ab_log.txt"
