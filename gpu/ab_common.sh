# Sourced by the A/B scripts (gpu/run_host_ab.sh, gpu/run_kernel_ab.sh, gpu/run_begin_ab.sh): two kvcanary wheels
# side by side on one GPU machine, this tree's (B: .whl, installed in /tmp/site with the tvm-ffi wheel) and an earlier
# commit's (A: .ab/wheelA, in /tmp/siteA, found first on A's path). Both sides run this tree's bench code.

# Install both sites and print the GPU.
ab_install() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/siteA \
    .ab/wheelA/*.whl || return 1
  export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 KVCANARY_CACHE_DIR=/tmp/kvcanary-jit
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
}

# ab_runs NAME FN: FN TAG for A1 B1 A2 B2 (alternating, so that a slow stretch of the host hits both sides), each
# with PYTHONPATH on that side's site.
ab_runs() {
  local run side
  for run in 1 2; do
    for side in A B; do
      echo "=== $1 $side$run $(date -u +%T)"
      if [ $side = A ]; then
        PYTHONPATH=/tmp/siteA:/tmp/site:$PWD "$2" "$side$run"
      else
        PYTHONPATH=/tmp/site:$PWD "$2" "$side$run"
      fi
    done
  done
}

# The closing lines of an A/B log.
ab_done() {
  echo "=== JIT builds during the run: $(find /tmp/kvcanary-jit -name '*.so' 2>/dev/null | wc -l) (0 expected)"
  echo "=== done $(date -u +%T)"
}
