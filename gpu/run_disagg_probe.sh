#!/usr/bin/env bash
# Where does the decode role hang after the prefill dies over NCCL (tests/disagg/test_disagg_gpu.py::
# test_dead_peers_over_nccl)? One kill_prefill launch per variant, each bounded at 20 + 10 + 10 = 40 s; a role killed
# at the bound reports every thread's Python stack (the launcher's hang_stacks).
#   cur, cur_nocanary, cur_noref   this tree's Python on the .whl kvcanary wheel's native modules
#   base                           the wheel in .ab/wheel_base (its own Python and native modules), e.g. a commit
#                                  before programmatic dependent launches
# Needs 2 GPUs (kind nvidia-h100-x2 / nvidia-h200-x2). Usage (repo root): OUT=... bash gpu/run_disagg_probe.sh
set -o pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_NCCL_ASYNC_ERROR_HANDLING=2 PYTHONUNBUFFERED=1 TVM_FFI_CUDA_ARCH_LIST=9.0a
export TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING=false
PIP="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade"
RUN="-m kvcanary.disagg --device cuda --model full --requests 4 --prompt-len 20 --max-new-tokens 4 --seed 3
     --fault kill_prefill --fault-seed 5 --target 1 --timeout 10 --idle-timeout 10 --startup 20 --json"
{
  $PIP --target /tmp/site .whl/*.whl
  nvidia-smi --query-gpu=name --format=csv,noheader
  cur() { PYTHONPATH=$PWD/python:$PWD/generated/python:/tmp/site KVCANARY_NATIVE_DIR=/tmp/site/kvcanary/_lib \
          timeout 120 python3 $RUN "$@"; }
  echo "=== cur $(date -u +%T)"; cur --out "$OUT/cur.json" > /dev/null
  echo "=== cur_nocanary $(date -u +%T)"; cur --no-canary --out "$OUT/cur_nocanary.json" > /dev/null
  echo "=== cur_noref $(date -u +%T)"; cur --no-reference --out "$OUT/cur_noref.json" > /dev/null
  if ls .ab/wheel_base/*.whl > /dev/null 2>&1; then
    $PIP --target /tmp/site_base .whl/apache_tvm_ffi*.whl .ab/wheel_base/*.whl
    echo "=== base $(date -u +%T)"
    PYTHONPATH=/tmp/site_base timeout 120 python3 $RUN --out "$OUT/base.json" > /dev/null
  fi
  for f in cur cur_nocanary cur_noref base; do
    [ -f "$OUT/$f.json" ] && python3 -c "
import json; d = json.load(open('$OUT/$f.json')); r = d['runs'][0] if 'runs' in d else d
print('$f', 'wall', r['wall_s'], 'exit', r['exitcodes'], 'ok', r['ok'], 'decode error', r['errors']['decode'] and
      r['errors']['decode']['message'])
for role, s in (r.get('hang_stacks') or {}).items():
    if s: print('--- hung', role, 'stacks:'); print(s)"
  done
  echo "=== done $(date -u +%T)"
} 2>&1 | tee "$OUT/log.txt"
