// CPU entry point of the canary write (docs/ops-contract.md 5): serial per segment and half over core/write.cuh.
//
// Native signature (kvcanary_cpu and kvcanary_cuda export the same; absent optional tensors are 0-element int64
// tensors on the records' device, with the flag argument saying whether they are present):
//   write(records: int64 [S, H, RECORD_NUM_FIELDS], swa_map: int64 [M], is_swa: int64, reserved_slots: int64,
//         tag0: int64, tag1: int64 (LaunchTag of half 0 / half 1; tag1 ignored, e.g. -1, when H == 1),
//         plan: int64 [cap, NUM_PLAN_COLS], status: int64 [NUM_PLAN_STATUS_COLS], table: int32|int64 [R, L],
//         input_ids: int64 [T], positions: int64 [T], out_cache_loc: int64 [T] (table space),
//         ring_rows: int64 [cap, NUM_VIOLATION_COLS], ring_count: int64 [1],
//         counters: int64 [NUM_LAUNCH_TAGS, NUM_COUNTER_COLS], step: int64 [1],
//         checks: int64 (WriteCheck bits; STRUCTURAL reads table),
//         pool_tokens: int64 [R', L'], pool_lens: int64 [R'], has_pool: int64, token_offset: int64,
//         fp_table: int64 [H' >= H, n, NUM_FP_SOURCE_COLS], fp_mode: int64 (FingerprintMode; NONE = none),
//         fp_layer_stride: int64, table_page: int64 (slots per table entry, as plan_forward's),
//         workspace: int64 [W] (the CUDA tile scan's look-back scratch, docs/ops-contract.md 5: zeroed once, one write
//         op's own; 0-element = none; this serial backend checks it and needs none),
//         carries: int64 [1 + E, NUM_CARRY_COLS] with a carry bit in checks, else any int64 tensor (the CUDA scan's
//         kept chain carries, docs/ops-contract.md 5; this backend checks it, never arms it and computes every chain
//         itself: the same records)) -> None
//   (the same order as verify's native entry for the shared leading and trailing arguments)
#include <tvm/ffi/function.h>

#include "core/write.cuh"

namespace kvcanary {

void write(TensorView records, TensorView swa_map, int64_t is_swa, int64_t reserved_slots, int64_t tag0, int64_t tag1,
           TensorView plan, TensorView status, TensorView table, TensorView input_ids, TensorView positions,
           TensorView out_cache_loc, TensorView ring_rows, TensorView ring_count, TensorView counters, TensorView step,
           int64_t checks, TensorView pool_tokens, TensorView pool_lens, int64_t has_pool, int64_t token_offset,
           TensorView fp_table, int64_t fp_mode, int64_t fp_layer_stride, int64_t table_page, TensorView workspace,
           TensorView carries) {
  check_device_type(records, kDLCPU, "records");
  check_i64_tensor(workspace, records, 1, "workspace", "records");
  const WriteArgs a = make_write_args(records, swa_map, is_swa, reserved_slots, tag0, tag1, plan, status, table,
                                      input_ids, positions, out_cache_loc, ring_rows, ring_count, counters, step,
                                      checks, pool_tokens, pool_lens, has_pool, token_offset, fp_table, fp_mode,
                                      fp_layer_stride, table_page, carries);
  const int64_t nseg = plan_num_segments(a.status, a.plan_cap);
  for (int64_t seg = 0; seg < nseg; ++seg) {
    const int64_t* row = a.plan + seg * kNumPlanCols;
    if (plan_at(row, PlanCol::WRITE_LEN) == 0) continue;
    if (!write_range_ok(a, row)) {
      for (int64_t h = 0; h < a.halves; ++h) write_emit_range_error(a, row, h);
      continue;
    }
    WriteTally tally[MAX_HALVES] = {{0, 0, 0}, {0, 0, 0}};
    write_segment_serial(a, row, plan_at(row, PlanCol::WRITE_LEN), tally);
    for (int64_t h = 0; h < a.halves; ++h) write_tally_flush(a, h, tally[h]);
  }
  for (int64_t h = 0; h < a.halves; ++h) count(a.sink, a.tags[h], CounterCol::WRITE_RUNS, 1);
}

}  // namespace kvcanary

TVM_FFI_DLL_EXPORT_TYPED_FUNC(write, kvcanary::write);
