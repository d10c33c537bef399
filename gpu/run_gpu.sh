#!/usr/bin/env bash
# One whole GPU job: install the tvm-ffi wheel, build the CUDA module, GPU tests, compute-sanitizer on a bad-input
# fuzz, the benchmark; everything lands in $OUT (log.txt, junit.xml, sanitizer logs, bench/results files).
# Usage (on the GPU machine, repo root): bash gpu/run_gpu.sh [tests|sanitize|bench ...]   (default: all three)
set -o pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
STEPS=${*:-tests sanitize bench}
{
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD/python:$PWD/generated/python TVM_FFI_CUDA_ARCH_LIST=9.0a PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
  date -u
  time python3 -c "from kvcanary import _native; _native.module('cuda'); print('cuda module ok')"
  for step in $STEPS; do
    echo "=== $step $(date -u +%T)"
    case $step in
      tests)
        timeout ${T_TESTS:-220} python3 -m pytest -q -m gpu tests/gpu --maxfail=40 --tb=short -p no:cacheprovider --junitxml="$OUT/junit.xml" \
          -o junit_family=xunit2 2>&1 | tail -150 ;;
      sanitize)
        timeout ${T_MEMCHECK:-150} compute-sanitizer --tool memcheck --leak-check no --error-exitcode 9 --print-limit 20 \
          python3 -m tests.gpu.fuzz_bad_inputs --n ${FUZZ_N:-16} --large 1 > "$OUT/sanitizer_memcheck.txt" 2>&1
        echo "memcheck rc=$?"; tail -5 "$OUT/sanitizer_memcheck.txt"
        timeout ${T_RACECHECK:-110} compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 9 --print-limit 20 \
          python3 -m tests.gpu.fuzz_bad_inputs --n 4 --large 1 > "$OUT/sanitizer_racecheck.txt" 2>&1
        echo "racecheck rc=$?"; tail -5 "$OUT/sanitizer_racecheck.txt" ;;
      bench)
        timeout ${T_BENCH:-500} python3 -m bench.bench_gpu --out "$OUT" ${BENCH_ARGS:-} ;;
    esac
  done
  echo "=== done $(date -u +%T)"
} 2>&1 | tee "$OUT/log.txt"
