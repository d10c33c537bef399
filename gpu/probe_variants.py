"""Probe helper (GPU machine): patch a copy of csrc/ for one variant and JIT-build it (gpu/probe_variants.sh).
Usage: python3 gpu/probe_variants.py VARIANT DIR (DIR/src holds the copies; the module goes to DIR/build). A variant's
edits are of the source it was measured on (bench/results/kernel_session12/probes.md names the commits); once that
source changes, the variant stops with a message instead of building something else."""

import glob
import sys
from pathlib import Path

import tvm_ffi.cpp
from kvcanary import _native

EMPTY = ("await_prior_kernels();", "await_prior_kernels(); if (threadIdx.x < 100000) return;")
W, V, P, CW = "cuda/write.cu", "cuda/verify.cu", "cuda/plan.cu", "core/write.cuh"
V_SUM = "  block_sum_to_thread0<kVerifyThreads, 3>(counts, s_reduce);\n  if (threadIdx.x == 0) {"
V_COUNTS = "    for (int64_t h = 0; h < halves; ++h) {\n      count(P.sink, P.tags[h], CounterCol::ENTRIES_CHECKED"
V_RUNS = "      if (blockIdx.x == 0) count(P.sink, P.tags[h], CounterCol::VERIFY_RUNS, 1);"
V_RUNS_0 = "      if (blockIdx.x == 0 && threadIdx.x == 0) count(P.sink, P.tags[h], CounterCol::VERIFY_RUNS, 1);"
W_RUNS = "count(a.sink, a.tags[h], CounterCol::WRITE_RUNS, 1);"
W_FLUSH = "        for (int64_t h = 0; h < a.halves; ++h) write_tally_flush(a, h, tally[h]);"
W_SERIAL = "write_segment_serial("
SEEDS = ("  WriteSeed seeds[MAX_HALVES];\n  for (int h = 0; h < MAX_HALVES; ++h) seeds[h] = h < a.halves ? "
         "write_seed_value(a, row, h) : WriteSeed{false, 0, 0};")
PLAN_PREFETCH = "\n      if (a.expect_prefix != nullptr) prefetch_l1"
VARIANTS: dict[str, list[tuple[str, str, str]]] = {
    "base": [],
    "w_empty": [(W, *EMPTY)],
    "v_empty": [(V, *EMPTY)],
    "all_empty": [(W, *EMPTY), (V, *EMPTY), (P, *EMPTY)],
    # the serial segment loop skipped (the range checks, sums and counter flush kept)
    "w_noserial": [(W, f"if (serial && len > 0) {W_SERIAL}", f"if (serial && len < 0) {W_SERIAL}")],
    # the kernel ends after the serial path (no block sum, no counter flush)
    "w_noflush": [(W, "  int64_t counts[3 * MAX_HALVES] = {tally[0].written",
                   "  if (serial) return;\n  int64_t counts[3 * MAX_HALVES] = {tally[0].written")],
    "w_noprefetch": [(W, "  own.prefetch(a);\n", "")],
    "w_noblock0": [(W, "  if (blockIdx.x == 0) {\n    for (int64_t s = threadIdx.x; s < nseg;",
                    "  if (blockIdx.x == 1000) {\n    for (int64_t s = threadIdx.x; s < nseg;")],
    # no counter atomics at the end (the block sum kept)
    "w_nocount": [(W, "      write_tally_flush(a, h, WriteTally{counts[3 * h]",
                   "      if (h < 0) write_tally_flush(a, h, WriteTally{counts[3 * h]")],
    # no block sum: each thread flushes its own tally (one atomic per nonzero count per thread)
    "w_nosum": [(W, "  block_sum_to_thread0<kWriteThreads, 3 * MAX_HALVES>(counts, s_reduce);\n"
                    "  if (threadIdx.x == 0) {", "  {")],
    # the record store skipped
    "w_nostore": [(CW, "  write_record(a, e.slot, half) = CanaryRecord{",
                   "  if (e.slot < -5) write_record(a, e.slot, half) = CanaryRecord{")],
    # the seed record never read (every seed a chain head)
    "w_noseed": [(CW, "  if (plan_flag(row, PlanFlag::SEED_IS_HEAD)) return WriteSeed{true, chain_h0(), -1};",
                  "  if (true) return WriteSeed{true, chain_h0(), -1};")],
    # the verify's closing counts skipped (its block sum kept)
    "v_nocount": [(V, f"  if (threadIdx.x == 0) {{\n{V_COUNTS}", f"  if (threadIdx.x == 100000) {{\n{V_COUNTS}")],
    # the verify's counts summed per warp and flushed by each warp's lane 0 (no block-wide sum)
    "v_warpflush": [(V, V_SUM, "  for (int k = 0; k < 3; ++k) counts[k] = warp_sum_i64(counts[k]);\n"
                               "  if (threadIdx.x % kWarp == 0) {"), (V, V_RUNS, V_RUNS_0)],
    # the verify's counts flushed by every thread (no sums; a measurement only: a large grid would issue one atomic per
    # thread)
    "v_ownflush": [(V, V_SUM, "  {"), (V, V_RUNS, V_RUNS_0)],
    # the write's WRITE_RUNS count at the end (thread 0's flush) instead of block 0's start (decode path only)
    "w_runs_last": [(W, f"      for (int64_t h = 0; h < a.halves; ++h) {W_RUNS}\n", ""),
                    (W, W_FLUSH, f"{W_FLUSH}\n        if (threadIdx.x == 0) for (int64_t h = 0; h < a.halves; ++h) "
                                 f"{W_RUNS}")],
    # the verify's next-entry prefetch skipped
    "v_nonext": [(V, "    if (nseg <= kSmemSegments) {", "    if (nseg < 0) {")],
    # the plan's L1 prefetches skipped
    "p_noprefetch": [(P, f"    if (in) {{{PLAN_PREFETCH}", f"    if (in && a.bs < 0) {{{PLAN_PREFETCH}")],
    # the serial write's halves one at a time (each half's seed read after the previous half's stores), as before
    # 54788c3
    "w_kv_seq": [(CW, SEEDS, ""), (CW, "    const WriteSeed seed = h == 0 ? seeds[0] : seeds[1];",
                                   "    const WriteSeed seed = write_seed_value(a, row, h);")],
    # the look-back write (an extend: several tiles with a workspace), timing only (results may be wrong):
    # each tile is its block index, no ticket atomic
    "x_noticket": [(W, "      s_ws[0] = static_cast<int64_t>(atomicAdd(reinterpret_cast<unsigned long long*>(ws.data + "
                       "kWsTicket), 1ULL));", "      s_ws[0] = blockIdx.x;")],
    # no look-back and no own reduction: a tile's first segment starts from the identity
    "x_nolookback": [(W, "      if (first_j > 0 && ws.data != nullptr) {  // block-uniform",
                      "      if (first_j > 0 && ws.data != nullptr && blockIdx.x > 100000) {"),
                     (W, "      } else if (first_j > 0) {", "      } else if (first_j > 0 && ws.data == nullptr) {")],
    # no structural check (its table load)
    "x_nostruct": [(CW, "  if (!write_check(a, WriteCheck::STRUCTURAL) || e.loc < 0) return;", "  return;")],
    # the closing block sum skipped (thread 0 flushes its own tally)
    "x_nosum": [(W, "  block_sum_to_thread0<kWriteThreads, 3 * MAX_HALVES>(counts, s_reduce);\n", "")],
    # 512-token tiles (two items per thread) on the look-back path
    "x_tile512": [(W, "    const int64_t grid = blocks(kWriteThreads);\n    go(write_kernel<1, false>, grid, "
                      "kWriteThreads, ws_for(grid, kWriteThreads));",
                   "    const int64_t grid = blocks(2 * kWriteThreads);\n    go(write_kernel<2, false>, grid, "
                   "2 * kWriteThreads, ws_for(grid, 2 * kWriteThreads));")],
}


def main() -> None:
    var, d = sys.argv[1], Path(sys.argv[2])
    for rel, old, new in VARIANTS[var]:
        path = d / "src" / "csrc" / rel
        text = path.read_text()
        if old not in text:
            raise SystemExit(f"{var}: {old!r} not in {rel}")
        path.write_text(text.replace(old, new, 1))
    tvm_ffi.cpp.build("kvcanary_cuda", cuda_files=sorted(glob.glob(f"{d}/src/csrc/cuda/*.cu")),
                      extra_cuda_cflags=_native.CUDA_FLAGS,
                      extra_include_paths=[f"{d}/src/csrc", f"{d}/src/include"], build_directory=f"{d}/build")


if __name__ == "__main__":
    main()
