// CPU entry point of verify (docs/ops-contract.md 4). Native signature (identical in csrc/cuda/verify.cu):
//   verify(records, swa_map, has_swa_map, reserved_slots, tag_k, tag_v, plan, status, table,
//          ring_rows, ring_count, counters, step, pool_tokens, pool_lens, has_pool, token_offset,
//          fp_table, fp_mode, fp_layer_stride)
//     records int64 [S, H, RECORD_NUM_FIELDS] (H in {1, 2}); swa_map int64 [M] (SWA) or 0-element with
//     has_swa_map = 0; reserved_slots in [0, S]; tag_k / tag_v LaunchTag values (tag_v ignored, pass -1, when H = 1);
//     plan int64 [cap, NUM_PLAN_COLS]; status int64 [NUM_PLAN_STATUS_COLS] (read: NUM_SEGMENTS); table int32|int64
//     [R, L]; ring_rows int64 [cap, NUM_VIOLATION_COLS], ring_count int64 [1], counters int64 [NUM_LAUNCH_TAGS,
//     NUM_COUNTER_COLS], step int64 [1]; pool_tokens int64 [R', L'] and pool_lens int64 [R'] or 0-element with
//     has_pool = 0, token_offset >= 0; fp_table int64 [H, n, NUM_FP_SOURCE_COLS] or 0-element with fp_mode = NONE,
//     fp_layer_stride >= 1. All scalars and flags int64.
#include <tvm/ffi/function.h>

#include "core/tensor_checks.h"
#include "core/verify.cuh"

namespace kvcanary {

namespace {

void check_tag(int64_t tag, const char* name) {
  TVM_FFI_CHECK(tag >= 0 && tag < kNumLaunchTags, ValueError) << name << " must be a LaunchTag, got " << tag;
}

}  // namespace

void verify(TensorView records, TensorView swa_map, int64_t has_swa_map, int64_t reserved_slots, int64_t tag_k,
            int64_t tag_v, TensorView plan, TensorView status, TensorView table, TensorView ring_rows,
            TensorView ring_count, TensorView counters, TensorView step, TensorView pool_tokens, TensorView pool_lens,
            int64_t has_pool, int64_t token_offset, TensorView fp_table, int64_t fp_mode, int64_t fp_layer_stride) {
  check_i64_tensor(records, records, 3, "records", "records");
  check_device_type(records, kDLCPU, "records");
  const int64_t num_slots = records.size(0), halves = records.size(1);
  TVM_FFI_CHECK(halves == 1 || halves == 2, ValueError) << "records.shape[1] must be 1 or 2, got " << halves;
  check_dim(records, 2, static_cast<int64_t>(sizeof(CanaryRecord) / sizeof(int64_t)), "records");
  check_i64_tensor(swa_map, records, 1, "swa_map", "records");
  TVM_FFI_CHECK(has_swa_map != 0 || swa_map.size(0) == 0, ValueError) << "swa_map must be empty when absent";
  TVM_FFI_CHECK(reserved_slots >= 0 && reserved_slots <= num_slots, ValueError)
      << "reserved_slots must be in [0, " << num_slots << "], got " << reserved_slots;
  check_tag(tag_k, "tag_k");
  if (halves == 2) check_tag(tag_v, "tag_v");
  check_i64_tensor(plan, records, 2, "plan", "records");
  check_dim(plan, 1, kNumPlanCols, "plan");
  check_i64_tensor(status, records, 1, "status", "records");
  check_dim(status, 0, kNumPlanStatusCols, "status");
  check_index_dtype(table, "table");
  check_ndim(table, 2, "table");
  check_contiguous(table, "table");
  check_same_device(table, records, "table", "records");
  check_i64_tensor(ring_rows, records, 2, "ring_rows", "records");
  check_dim(ring_rows, 1, kNumViolationCols, "ring_rows");
  check_i64_tensor(ring_count, records, 1, "ring_count", "records");
  check_dim(ring_count, 0, 1, "ring_count");
  check_i64_tensor(counters, records, 2, "counters", "records");
  check_dim(counters, 0, kNumLaunchTags, "counters");
  check_dim(counters, 1, kNumCounterCols, "counters");
  check_i64_tensor(step, records, 1, "step", "records");
  check_dim(step, 0, 1, "step");
  if (has_pool != 0) {
    check_i64_tensor(pool_tokens, records, 2, "pool_tokens", "records");
    check_i64_tensor(pool_lens, records, 1, "pool_lens", "records");
    check_dim(pool_lens, 0, pool_tokens.size(0), "pool_lens");
    TVM_FFI_CHECK(token_offset >= 0, ValueError) << "token_offset must be >= 0, got " << token_offset;
  }
  TVM_FFI_CHECK(fp_mode >= static_cast<int64_t>(FingerprintMode::NONE) &&
                    fp_mode <= static_cast<int64_t>(FingerprintMode::ALL),
                ValueError)
      << "fp_mode must be a FingerprintMode, got " << fp_mode;
  const bool want_fp = fp_mode != static_cast<int64_t>(FingerprintMode::NONE);
  if (want_fp) {
    check_i64_tensor(fp_table, records, 3, "fp_table", "records");
    TVM_FFI_CHECK(fp_table.size(0) >= halves, ValueError)
        << "fp_table has " << fp_table.size(0) << " halves, records " << halves;
    check_dim(fp_table, 2, kNumFpSourceCols, "fp_table");
    TVM_FFI_CHECK(fp_table.size(1) >= 1, ValueError) << "fp_table needs at least one source";
    TVM_FFI_CHECK(fp_layer_stride >= 1, ValueError) << "fp_layer_stride must be >= 1, got " << fp_layer_stride;
  }

  VerifyParams P;
  P.records = static_cast<const int64_t*>(records.data_ptr());
  P.halves = halves;
  P.group = GroupView{num_slots, reserved_slots,
                      has_swa_map != 0 ? static_cast<const int64_t*>(swa_map.data_ptr()) : nullptr,
                      has_swa_map != 0 ? swa_map.size(0) : 0};
  P.table = SlotTable{table.data_ptr(), is_i32(table), table.size(0), table.size(1)};
  P.tags[0] = tag_k;
  P.tags[1] = halves == 2 ? tag_v : tag_k;
  P.sink = SinkView{static_cast<int64_t*>(ring_rows.data_ptr()), static_cast<int64_t*>(ring_count.data_ptr()),
                    ring_rows.size(0), static_cast<int64_t*>(counters.data_ptr()),
                    static_cast<const int64_t*>(step.data_ptr())};
  P.pool = has_pool != 0 ? TokenPoolView{static_cast<const int64_t*>(pool_tokens.data_ptr()),
                                         static_cast<const int64_t*>(pool_lens.data_ptr()), pool_tokens.size(0),
                                         pool_tokens.size(1), token_offset}
                         : TokenPoolView{nullptr, nullptr, 0, 0, 0};
  P.fp = want_fp ? FpView{static_cast<const int64_t*>(fp_table.data_ptr()), fp_table.size(1),
                          static_cast<int32_t>(fp_mode), fp_layer_stride}
                 : FpView{nullptr, 0, static_cast<int32_t>(FingerprintMode::NONE), 1};

  int64_t checked = 0, skipped = 0, errors = 0;
  const auto* plan_rows = static_cast<const int64_t*>(plan.data_ptr());
  const int64_t nseg = plan_num_segments(static_cast<const int64_t*>(status.data_ptr()), plan.size(0));
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
            want_fp && chain_value_ok(e.position)
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
