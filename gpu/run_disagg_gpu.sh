#!/usr/bin/env bash
# Prefill->decode disaggregation on two GPUs over NCCL (control messages over gloo): the GPU e2e tests, then the
# launcher's clean runs (overhead figures) and fault campaign. Everything lands in $OUT:
#   log.txt, junit_disagg.xml, disagg_gpu.json (clean runs: swa/wide), disagg_gpu_faults.json.
# Needs a machine with 2 GPUs (kind nvidia-h200-x2) and the tvm-ffi wheel in .whl (../shared/tools/fetch-gpu-wheels).
# Budget: about 6 minutes (each launch spawns two fresh processes); the step timeouts add up to 580 s.
# Usage (repo root): bash gpu/run_disagg_gpu.sh
set -o pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_NCCL_BLOCKING_WAIT=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=2
{
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD/python:$PWD/generated/python TVM_FFI_CUDA_ARCH_LIST=9.0a PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,memory.total --format=csv
  date -u
  # build the CUDA module once, before two role processes would race to JIT-build it
  time timeout 150 python3 -c "from kvcanary import _native; _native.module('cuda'); print('cuda module ok')"
  echo "=== tests $(date -u +%T)"
  timeout 180 python3 -m pytest -q -m gpu tests/disagg/test_disagg_gpu.py -p no:cacheprovider \
    --junitxml="$OUT/junit_disagg.xml" -o junit_family=xunit2 2>&1 | tail -30
  echo "=== clean runs $(date -u +%T)"
  timeout 80 python3 -m kvcanary.disagg --device cuda --model swa wide --requests 8 --json \
    --out "$OUT/disagg_gpu.json" > /dev/null; echo "rc=$?"
  python3 -c "
import json; d = json.load(open('$OUT/disagg_gpu.json'))
for r in d['runs']:
    print(r['model'], 'ok', len(r['ok']), 'failed', r['failed'], 'match', r['outputs_match_reference'], r['overhead'])"
  echo "=== fault campaign $(date -u +%T)"
  # a module, not a heredoc: spawned role processes must be able to re-import the parent's __main__
  timeout 170 python3 -m kvcanary.disagg --device cuda --model swa --fault all --requests 4 --json \
    --out "$OUT/disagg_gpu_faults.json" > /dev/null; echo "rc=$?"
  echo "=== done $(date -u +%T)"
} 2>&1 | tee "$OUT/log.txt"
