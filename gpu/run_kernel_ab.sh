#!/usr/bin/env bash
# Kernel-path A/B on one GPU machine: bench_gpu --quick (the scenarios with absolute targets, CUDA graph replay) for an
# earlier commit A and this tree B, alternating A B A B in one job, each on its own installed wheel (the same
# bench_gpu.py for both, from this tree). Files in $OUT/kernel_ab: ab_log.txt gpu_{A,B}{1,2}.{json,md}.
# A: `git worktree add /tmp/A <commit> && pip wheel --no-deps -w .ab/wheelA /tmp/A` (carry .ab and .whl).
# Needs .whl with the tvm-ffi wheel and this tree's kvcanary wheel. Usage (repo root): bash gpu/run_kernel_ab.sh
set -o pipefail
OUT=${OUT:-/tmp/out}/kernel_ab
mkdir -p "$OUT"
{
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/siteA \
    .ab/wheelA/*.whl || exit 1
  export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 KVCANARY_CACHE_DIR=/tmp/kvcanary-jit
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
  for run in 1 2; do
    for side in A B; do
      echo "=== bench_gpu $side$run $(date -u +%T)"
      site=/tmp/site
      [ $side = A ] && site=/tmp/siteA:/tmp/site
      PYTHONPATH=$site:$PWD timeout 150 python3 -m bench.bench_gpu --quick --samples 20 --out "/tmp/kab_$side$run" \
        | grep -E "^\| (decode|extend|swa)" | cut -d'|' -f2-4
      for f in /tmp/kab_$side$run/*.json /tmp/kab_$side$run/*.md; do cp "$f" "$OUT/gpu_$side$run.${f##*.}"; done
    done
  done
  echo "=== JIT builds during the run: $(find /tmp/kvcanary-jit -name '*.so' 2>/dev/null | wc -l) (0 expected)"
  echo "=== done $(date -u +%T)"
} 2>&1 | tee "$OUT/ab_log.txt"
