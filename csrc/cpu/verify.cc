// CPU entry point of verify (docs/ops-contract.md 4). Native signature (identical in csrc/cuda/verify.cu):
//   verify(records, swa_map, has_swa_map, reserved_slots, tag_k, tag_v, plan, status, table,
//          ring_rows, ring_count, counters, step, pool_tokens, pool_lens, has_pool, token_offset,
//          fp_table, fp_mode, fp_layer_stride, table_page, fp_share, max_segment_entries)
//     records int64 [S, H, RECORD_NUM_FIELDS] (H in {1, 2}); swa_map int64 [M] (SWA) or 0-element with
//     has_swa_map = 0; reserved_slots in [0, S]; tag_k / tag_v LaunchTag values (tag_v ignored, pass -1, when H = 1);
//     plan int64 [cap, NUM_PLAN_COLS]; status int64 [NUM_PLAN_STATUS_COLS] (read: NUM_SEGMENTS); table int32|int64
//     [R, L]; ring_rows int64 [cap, NUM_VIOLATION_COLS], ring_count int64 [1], counters int64 [NUM_LAUNCH_TAGS,
//     NUM_COUNTER_COLS], step int64 [1]; pool_tokens int64 [R', L'] and pool_lens int64 [R'] or 0-element with
//     has_pool = 0, token_offset >= 0; fp_table int64 [H, n, NUM_FP_SOURCE_COLS] or 0-element with fp_mode = NONE,
//     fp_layer_stride >= 1; table_page >= 1 (slots per table entry, slot = table[r, c / page] * page + c % page);
//     fp_share a power of two >= 1 (an entry's fingerprint is checked iff (position + PREFIX_LEN) % fp_share == 0);
//     max_segment_entries >= 0: the caller's bound on any segment's IDX_END - IDX_BEGIN (0: none), used by the CUDA
//     backend to size its grid only; a segment with more entries is still verified whole.
//     All scalars and flags int64.
#include <tvm/ffi/function.h>

#include "core/verify_args.h"

namespace kvcanary {

void verify(TensorView records, TensorView swa_map, int64_t has_swa_map, int64_t reserved_slots, int64_t tag_k,
            int64_t tag_v, TensorView plan, TensorView status, TensorView table, TensorView ring_rows,
            TensorView ring_count, TensorView counters, TensorView step, TensorView pool_tokens, TensorView pool_lens,
            int64_t has_pool, int64_t token_offset, TensorView fp_table, int64_t fp_mode, int64_t fp_layer_stride,
            int64_t table_page, int64_t fp_share, int64_t max_segment_entries) {
  const VerifyArgs a = make_verify_args(kDLCPU, records, swa_map, has_swa_map, reserved_slots, tag_k, tag_v, plan,
                                        status, table, ring_rows, ring_count, counters, step, pool_tokens, pool_lens,
                                        has_pool, token_offset, fp_table, fp_mode, fp_layer_stride, table_page,
                                        fp_share, max_segment_entries);
  const VerifyParams& P = a.P;
  const int64_t halves = P.halves;
  const bool want_fp = a.want_fp;

  int64_t checked = 0, skipped = 0, errors = 0;
  const int64_t* plan_rows = a.plan;
  const int64_t nseg = plan_num_segments(a.status, a.plan_cap);
  for (int64_t k = 0; k < nseg; ++k) {
    const int64_t* seg = plan_rows + k * kNumPlanCols;
    if (!verify_segment_ok(P, seg)) {
      verify_emit_bad_segment(P, seg);
      ++errors;
      continue;
    }
    for (int64_t idx = seg[col(PlanCol::IDX_BEGIN)]; idx < seg[col(PlanCol::IDX_END)]; ++idx) {
      const VerifyEntry e = verify_locate(P, seg, idx);
      if (e.slot.status == SlotStatus::kInputError) {
        verify_emit_input_error(P, seg, e);
        ++errors;
        continue;
      }
      if (e.slot.status != SlotStatus::kOk) {
        ++skipped;
        continue;
      }
      ++checked;
      for (int64_t h = 0; h < halves; ++h) {
        const uint64_t fp =
            want_fp && chain_value_ok(e.position) && verify_fp_selected(P, seg, e.position)
                ? fingerprint_serial(P.fp.table, P.fp.n_sources, h, e.slot.slot, e.position, P.fp.mode,
                                         P.fp.layer_stride)
                    : 0;
        verify_check_half(P, seg, idx, e, h, fp);
      }
    }
  }
  for (int64_t h = 0; h < halves; ++h) {
    count(P.sink, P.tags[h], CounterCol::VERIFY_RUNS, 1);
    count(P.sink, P.tags[h], CounterCol::ENTRIES_CHECKED, checked);
    count(P.sink, P.tags[h], CounterCol::SKIPPED, skipped);
    count(P.sink, P.tags[h], CounterCol::INPUT_ERRORS, errors);
  }
}

}  // namespace kvcanary

TVM_FFI_DLL_EXPORT_TYPED_FUNC(verify, kvcanary::verify);
