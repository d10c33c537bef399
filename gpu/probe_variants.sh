#!/usr/bin/env bash
# Probe (GPU machine): JIT-build variants of the CUDA module from patched copies of csrc/ and time
# gpu/probe_graph_parts.py on each: what a part of a kernel's body costs in a small forward's graph. A variant is a
# list of (file, text, replacement) edits in gpu/probe_variants.py. Usage (after installing .whl into /tmp/site):
# bash gpu/probe_variants.sh VARIANT... [-- SCENARIO...]
set -o pipefail
export TVM_FFI_CUDA_ARCH_LIST=9.0a PYTHONUNBUFFERED=1
variants=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do variants+=("$1"); shift; done; shift
for var in "${variants[@]}"; do
  d=/tmp/variant_$var
  rm -rf "$d" && mkdir -p "$d/src" && cp -r csrc "$d/src/csrc" && cp -r generated/include "$d/src/include"
  python3 gpu/probe_variants.py "$var" "$d" || exit 1
  echo "=== variant $var"
  KVCANARY_NATIVE_DIR=$d/build timeout 200 python3 gpu/probe_graph_parts.py "$@"
done
