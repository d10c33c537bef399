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
  timeout 170 python3 - "$OUT/disagg_gpu_faults.json" <<'PY'
import json, sys
from kvcanary.disagg.engines import Workload
from kvcanary.disagg.launcher import LaunchConfig, launch
from kvcanary.disagg.transport import FaultName, FaultSpec
rows = []
for model in ("swa",):  # FULL and SWA groups; the dead-peer faults are in the tests above
    for fault in ("corrupt", "truncate_layers", "truncate_tail", "swap", "stale", "bad_length", "bad_header",
                  "stall_decode"):
        r = launch(LaunchConfig(device="cuda", model=model, workload=Workload(4, 20, 20, 4, seed=3),
                                fault=FaultSpec(FaultName(fault), 1, seed=5), timeout_s=8.0, idle_timeout_s=12.0))
        rows.append(r)
        print(model, fault, "ok", r["ok"], "failed", r["failed"], "detected", r["detected"],
              "prefill_violations", r["prefill_violations"], "match", r["outputs_match_reference"],
              "errors", {k: v and v["type"] for k, v in r["errors"].items()}, "exit", r["exitcodes"], flush=True)
json.dump({"runs": rows}, open(sys.argv[1], "w"), indent=1, default=str)
PY
  echo "=== done $(date -u +%T)"
} 2>&1 | tee "$OUT/log.txt"
