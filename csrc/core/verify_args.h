// Host checks of every verify argument and the raw view the kernels run on (shared by the CPU and CUDA entries).
#pragma once

#include "tensor_checks.h"
#include "verify.cuh"

namespace kvcanary {

// What a verify launch needs besides the per-entry view: the plan and its device-side status.
struct VerifyArgs {
  VerifyParams P;
  const int64_t* plan;
  int64_t plan_cap;
  const int64_t* status;
  bool want_fp;
  int64_t max_segment_entries;  // a bound on any segment's entries for launch geometry only (0: none given)
};

inline void check_launch_tag(int64_t tag, const char* name) {
  TVM_FFI_CHECK(tag >= 0 && tag < kNumLaunchTags, ValueError) << name << " must be a LaunchTag, got " << tag;
}

// Validates every argument (raising ValueError/TypeError naming it) before any launch; `device` is the backend's.
inline VerifyArgs make_verify_args(DLDeviceType device, TensorView records, TensorView swa_map, int64_t has_swa_map,
                                   int64_t reserved_slots, int64_t tag_k, int64_t tag_v, TensorView plan,
                                   TensorView status, TensorView table, TensorView ring_rows, TensorView ring_count,
                                   TensorView counters, TensorView step, TensorView pool_tokens, TensorView pool_lens,
                                   int64_t has_pool, int64_t token_offset, TensorView fp_table, int64_t fp_mode,
                                   int64_t fp_layer_stride, int64_t table_page, int64_t fp_share,
                                   int64_t max_segment_entries) {
  check_i64_tensor(records, records, 3, "records", "records");
  check_device_type(records, device, "records");
  const int64_t num_slots = records.size(0), halves = records.size(1);
  TVM_FFI_CHECK(halves == 1 || halves == MAX_HALVES, ValueError) << "records.shape[1] must be 1 or 2, got " << halves;
  check_dim(records, 2, static_cast<int64_t>(sizeof(CanaryRecord) / sizeof(int64_t)), "records");
  check_i64_tensor(swa_map, records, 1, "swa_map", "records");
  TVM_FFI_CHECK(has_swa_map != 0 || swa_map.size(0) == 0, ValueError) << "swa_map must be empty when absent";
  TVM_FFI_CHECK(reserved_slots >= 0 && reserved_slots <= num_slots, ValueError)
      << "reserved_slots must be in [0, " << num_slots << "], got " << reserved_slots;
  check_launch_tag(tag_k, "tag_k");
  if (halves == 2) check_launch_tag(tag_v, "tag_v");
  check_plan_status(plan, status, records, "records");
  check_slot_table(table, records, "table", "records");
  check_sink(ring_rows, ring_count, counters, step, records, "records");
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
    // A table may carry more halves than the records (a K-only group given K+V sources): only [0, H) is read.
    TVM_FFI_CHECK(fp_table.size(0) >= halves, ValueError)
        << "fp_table has " << fp_table.size(0) << " halves, records " << halves;
    check_dim(fp_table, 2, kNumFpSourceCols, "fp_table");
    TVM_FFI_CHECK(fp_table.size(1) >= 1, ValueError) << "fp_table needs at least one source";
    TVM_FFI_CHECK(fp_layer_stride >= 1, ValueError) << "fp_layer_stride must be >= 1, got " << fp_layer_stride;
  }
  TVM_FFI_CHECK(fp_share >= 1 && (fp_share & (fp_share - 1)) == 0, ValueError)
      << "fp_share must be a power of two >= 1, got " << fp_share;
  TVM_FFI_CHECK(max_segment_entries >= 0, ValueError)
      << "max_segment_entries must be >= 0, got " << max_segment_entries;

  VerifyArgs a{};
  VerifyParams& P = a.P;
  P.records = static_cast<const int64_t*>(records.data_ptr());
  P.halves = halves;
  P.group = GroupView{num_slots, reserved_slots,
                      has_swa_map != 0 ? static_cast<const int64_t*>(swa_map.data_ptr()) : nullptr,
                      has_swa_map != 0 ? swa_map.size(0) : 0};
  P.table = slot_table_of(table, table_page, "table");
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
                          static_cast<int32_t>(fp_mode), fp_layer_stride, fp_share}
                 : FpView{nullptr, 0, static_cast<int32_t>(FingerprintMode::NONE), 1, 1};
  a.plan = static_cast<const int64_t*>(plan.data_ptr());
  a.plan_cap = plan.size(0);
  a.status = static_cast<const int64_t*>(status.data_ptr());
  a.want_fp = want_fp;
  a.max_segment_entries = max_segment_entries;
  return a;
}

}  // namespace kvcanary
