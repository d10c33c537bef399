#!/usr/bin/env bash
# Prefill->decode disaggregation on two GPUs over NCCL (control messages over gloo). Steps (default: all):
#   tests     pytest -m gpu tests/disagg/test_disagg_gpu.py            -> $OUT/junit_disagg.xml
#   clean     launcher clean runs, swa + wide, 8 requests (overhead)   -> $OUT/disagg_gpu.json
#   campaign  `--fault all` (one line per fault) and a dead-peer probe  -> $OUT/disagg_gpu_faults.{json,txt},
#             with 20 s timeouts (NCCL never notices a dead peer)         $OUT/disagg_gpu_kill_prefill.json
# Everything is also logged to $OUT/log.txt. Needs 2 GPUs (kind nvidia-h200-x2 / nvidia-h100-x2) and the tvm-ffi
# wheel in .whl (../shared/tools/fetch-gpu-wheels).
# Limits: each launcher step is killed at the bound the launcher states for it (`--bound`) plus 30 s, so a hang shows
# up as a timeout of this script and never as a silently shorter campaign. `campaign` alone: build <= 120 s, campaign
# bound 10 x (25 s start + 5 s idle + 2 s step) + 2 s stall step = 322 s (+30), probe bound 25 + 20 + 20 = 65 s (+30):
# 567 s at worst, under the device's 600 s per call (a launch took about 8 s on H200s). `tests` (<= 300 s) and
# `clean` (bound 2 x (30 + 60 + 10) = 200 s, +30) go in a second call where calls are capped.
# Usage (repo root): bash gpu/run_disagg_gpu.sh [all|tests|clean|campaign]...
set -o pipefail
OUT=${OUT:-/tmp/out}
STEPS=${*:-all}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_NCCL_ASYNC_ERROR_HANDLING=2
DISAGG="python3 -m kvcanary.disagg --device cuda"
CAMPAIGN="$DISAGG --fault all --model swa --requests 4 --startup 25"  # timeouts: the campaign's own (2 s / 5 s)
PROBE="$DISAGG --fault kill_prefill --model full --requests 4 --timeout 20 --idle-timeout 20 --startup 25"

bounded() {  # bounded CMD...: run a launcher command under its stated bound + 30 s
  local bound
  bound=$("$@" --bound | cut -d. -f1) || return 1
  echo "+ timeout $((bound + 30)) $*  (stated bound ${bound} s)"
  timeout $((bound + 30)) "$@"
}

want() { [[ " $STEPS " == *" all "* || " $STEPS " == *" $1 "* ]]; }

{
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD/python:$PWD/generated/python TVM_FFI_CUDA_ARCH_LIST=9.0a PYTHONUNBUFFERED=1
  export TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING=false
  nvidia-smi --query-gpu=name,memory.total --format=csv
  date -u
  # build the CUDA module once, before two role processes would race to JIT-build it
  time timeout 120 python3 -c "from kvcanary import _native; _native.module('cuda'); print('cuda module ok')"
  if want tests; then
    echo "=== tests $(date -u +%T)"
    timeout 300 python3 -m pytest -q -m gpu tests/disagg/test_disagg_gpu.py -p no:cacheprovider \
      --junitxml="$OUT/junit_disagg.xml" -o junit_family=xunit2 2>&1 | tail -30
  fi
  if want clean; then
    echo "=== clean runs $(date -u +%T)"
    bounded $DISAGG --model swa wide --requests 8 --startup 30 --json --out "$OUT/disagg_gpu.json" > /dev/null
    echo "rc=$?"
    python3 -c "
import json; d = json.load(open('$OUT/disagg_gpu.json'))
for r in d['runs']:
    print(r['model'], 'ok', len(r['ok']), 'failed', r['failed'], 'match', r['outputs_match_reference'], r['overhead'])"
  fi
  if want campaign; then
    echo "=== fault campaign $(date -u +%T)"
    # a module, not a heredoc: spawned role processes must be able to re-import the parent's __main__
    bounded $CAMPAIGN --out "$OUT/disagg_gpu_faults.json" | tee "$OUT/disagg_gpu_faults.txt"; echo "rc=$?"
    echo "=== dead prefill with 20 s timeouts: seen at once over NCCL? $(date -u +%T)"
    bounded $PROBE --json --out "$OUT/disagg_gpu_kill_prefill.json" > /dev/null; echo "rc=$?"
    python3 -c "
import json; r = json.load(open('$OUT/disagg_gpu_kill_prefill.json'))
print('kill_prefill wall', r['wall_s'], 's; decode role', r['seconds']['decode'], 's;', r['errors']['decode'])"
  fi
  echo "=== done $(date -u +%T)"
} 2>&1 | tee "$OUT/log.txt"
