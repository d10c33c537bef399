#!/usr/bin/env bash
# One single-GPU record on the installed wheel (its prebuilt CUDA module; the job stops if the loader would JIT):
# every GPU test (CUDA ops bit-exact vs the torch reference, graph capture/replay, runtime, engine, default policy,
# structural check, transformers), compute-sanitizer memcheck + racecheck on the bad-input fuzz, the quick benchmark,
# the default-policy rows (issue 14) and the CUDA demo. Files in $OUT (at most 8): log.txt sanitizer.txt
# demo_cuda.json bench_structural.{json,md} bench_policy.{json,md}.
# Needs .whl with the tvm-ffi wheel (../shared/tools/fetch-gpu-wheels) and a kvcanary wheel (pip wheel --no-deps .
# where nvcc is), and .hfproto/wheels/transformers-5.23.0 for the transformers tests. Usage: bash gpu/run_record.sh
# (NO_BENCH=1: skip the two benchmark steps, for a change that leaves every kernel as it was; SRC_PY=1: this tree's
# Python on the wheel's native library, for Python changed since the wheel was built; JIT=1: this tree's Python and
# its C++/CUDA sources, JIT-built once at the start (the wheel then only supplies tvm-ffi and the transformers pins)).
set -o pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
{
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl $(ls .hfproto/wheels/*.whl 2>/dev/null) || exit 1
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KVCANARY_RESULTS_DIR=/tmp/res HF_HUB_OFFLINE=1
  export KVCANARY_CACHE_DIR=/tmp/kvcanary-jit
  origin=packaged
  [ -z "${SRC_PY:-}" ] || { origin=native_dir; export PYTHONPATH=$PWD/python:$PWD/generated/python:$PYTHONPATH \
    KVCANARY_NATIVE_DIR=/tmp/site/kvcanary/_lib; }
  [ -z "${JIT:-}" ] || { origin=jit; rm -rf /tmp/site/kvcanary; export PYTHONPATH=$PWD/python:$PWD/generated/python:$PYTHONPATH \
    TVM_FFI_CUDA_ARCH_LIST=9.0a; }
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
  python3 -c "from kvcanary import _native; l = _native.load('cuda'); print('cuda module', l.origin, l.path, \
    _native.build_info()); raise SystemExit(l.origin != '$origin')" || exit 1
  echo "=== gpu tests $(date -u +%T)"
  # the exit status printed: an abort after the last test (a torch allocator assert at exit) keeps the pass count
  timeout 240 python3 -m pytest -q -m gpu tests --ignore=tests/disagg -p no:cacheprovider --tb=short --maxfail=40 \
    2>&1 | tail -40; echo "gpu tests rc=${PIPESTATUS[0]}"
  echo "=== sanitizer $(date -u +%T)"
  { timeout 150 compute-sanitizer --tool memcheck --leak-check no --error-exitcode 9 --print-limit 20 \
      python3 -m tests.gpu.fuzz_bad_inputs --n 12 --large 1 --runtime 30; echo "memcheck rc=$?"
    timeout 120 compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 9 --print-limit 20 \
      python3 -m tests.gpu.fuzz_bad_inputs --n 3 --large 1 --runtime 12; echo "racecheck rc=$?"; } > "$OUT/sanitizer.txt" 2>&1
  grep -E "rc=|ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/sanitizer.txt"
  [ -n "${NO_BENCH:-}" ] || {
  echo "=== bench $(date -u +%T)"
  timeout 220 python3 -m bench.bench_gpu --quick --samples 20 --out /tmp/bench_structural | tail -60
  echo "=== policy rows $(date -u +%T)"
  timeout 150 python3 -m bench.bench_gpu --samples 20 --out /tmp/bench_policy \
    --only "policy base,fp default (4,fp default serial,fp default each half,fp default no seal,fp default no look-back" | grep -v "^|" | tail -30
  for variant in structural policy; do
    for f in /tmp/bench_$variant/*.json /tmp/bench_$variant/*.md; do cp "$f" "$OUT/bench_$variant.${f##*.}"; done
  done; }
  echo "=== demo $(date -u +%T)"
  timeout 90 python3 -m kvcanary demo --device cuda --json > "$OUT/demo_cuda.json"; echo "demo rc=$?"
  echo "=== JIT builds during the run: $(find /tmp/kvcanary-jit -name '*.so' 2>/dev/null | wc -l) (0 expected; JIT=1: 2)"
  echo "=== done $(date -u +%T)"
} 2>&1 | tee "$OUT/log.txt"
