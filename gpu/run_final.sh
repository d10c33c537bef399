#!/usr/bin/env bash
# The whole single-GPU record in one job: every GPU test of the repo (CUDA ops bit-exact vs the torch reference,
# graph capture/replay of the runtime bracket, engine, transformers), compute-sanitizer memcheck + racecheck on a
# bad-input fuzz, the benchmark, and the CUDA demo. At most 8 files land in $OUT (the device tool's limit):
#   log.txt junit.xml sanitizer.txt gpu_<gpu>.{json,md,png} demo_cuda.json transformers_gpu.json
# Needs .whl (../shared/tools/fetch-gpu-wheels) and, for the transformers tests, a transformers==5.23.0 wheel in
# .hfproto/wheels (../shared/tools/fetch-gpu-wheels transformers==5.23.0, moved there). Usage: bash gpu/run_final.sh
# With a kvcanary wheel in .whl (pip wheel --no-deps . on a machine with nvcc), everything runs on the installed wheel
# and its prebuilt CUDA module (no JIT: the job fails if the module is not the packaged one); else on the checkout.
set -o pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
{
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl $(ls .hfproto/wheels/*.whl 2>/dev/null)
  if ls .whl/kvcanary-*.whl > /dev/null 2>&1; then want=packaged src=$PWD; else want=jit src=$PWD/python:$PWD/generated/python:$PWD; fi
  export PYTHONPATH=/tmp/site:$src TVM_FFI_CUDA_ARCH_LIST=9.0a PYTHONUNBUFFERED=1
  export KVCANARY_RESULTS_DIR="$OUT" HF_HUB_OFFLINE=1 KVCANARY_CACHE_DIR=/tmp/kvcanary-jit
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
  python3 -c "import torch, tvm_ffi, transformers; print(torch.__version__, tvm_ffi.__version__, transformers.__version__)"
  time timeout 200 python3 -c "from kvcanary import _native; l = _native.load('cuda'); print('cuda module', l.origin, \
    l.path, _native.build_info()); raise SystemExit(l.origin != '$want')" || exit 1
  [ "$want" = packaged ] && cuobjdump --list-elf /tmp/site/kvcanary/_lib/kvcanary_cuda.so
  echo "=== gpu tests $(date -u +%T)"
  timeout 240 python3 -m pytest -q -m gpu tests --ignore=tests/disagg -p no:cacheprovider --tb=short --maxfail=40 \
    --junitxml="$OUT/junit.xml" -o junit_family=xunit2 2>&1 | tail -60
  echo "=== sanitizer $(date -u +%T)"
  { timeout 150 compute-sanitizer --tool memcheck --leak-check no --error-exitcode 9 --print-limit 20 \
      python3 -m tests.gpu.fuzz_bad_inputs --n 16 --large 1; echo "memcheck rc=$?"
    timeout 110 compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 9 --print-limit 20 \
      python3 -m tests.gpu.fuzz_bad_inputs --n 4 --large 1; echo "racecheck rc=$?"; } > "$OUT/sanitizer.txt" 2>&1
  grep -E "rc=|ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/sanitizer.txt"
  echo "=== bench $(date -u +%T)"
  timeout 330 python3 -m bench.bench_gpu --out "$OUT" | tail -70
  echo "=== demo $(date -u +%T)"
  timeout 150 python3 -m kvcanary demo --device cuda --json > "$OUT/demo_cuda.json"; echo "demo rc=$?"
  echo "=== JIT builds during the run: $(find /tmp/kvcanary-jit -name '*.so' 2>/dev/null | wc -l) (0 expected with a wheel)"
  echo "=== done $(date -u +%T)"
} 2>&1 | tee "$OUT/log.txt"
