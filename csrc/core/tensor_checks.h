// Host-side argument validation shared by every tvm-ffi entry point: a clear ValueError/TypeError before any launch.
#pragma once

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>

#include <cstdint>
#include <initializer_list>
#include <utility>

#include "common.cuh"
#include "resolve.cuh"
#include "stage_batch.cuh"

namespace kvcanary {

using tvm::ffi::TensorView;

inline const char* dtype_name(DLDataType t) {
  if (t.code == kDLInt && t.bits == 64 && t.lanes == 1) return "int64";
  if (t.code == kDLInt && t.bits == 32 && t.lanes == 1) return "int32";
  if (t.code == kDLUInt && t.bits == 8 && t.lanes == 1) return "uint8";
  return "other";
}
inline bool is_i64(const TensorView& t) { return t.dtype() == DLDataType{kDLInt, 64, 1}; }
inline bool is_i32(const TensorView& t) { return t.dtype() == DLDataType{kDLInt, 32, 1}; }

inline void check_i64(const TensorView& t, const char* name) {
  TVM_FFI_CHECK(is_i64(t), TypeError) << name << " must be int64, got " << dtype_name(t.dtype());
}
inline void check_index_dtype(const TensorView& t, const char* name) {
  TVM_FFI_CHECK(is_i64(t) || is_i32(t), TypeError) << name << " must be int32 or int64, got " << dtype_name(t.dtype());
}
inline void check_contiguous(const TensorView& t, const char* name) {
  TVM_FFI_CHECK(t.IsContiguous(), ValueError) << name << " must be contiguous";
}
inline void check_ndim(const TensorView& t, int ndim, const char* name) {
  TVM_FFI_CHECK(t.ndim() == ndim, ValueError) << name << " must have " << ndim << " dims, got " << t.ndim();
}
inline void check_dim(const TensorView& t, int axis, int64_t size, const char* name) {
  TVM_FFI_CHECK(t.size(axis) == size, ValueError)
      << name << ".shape[" << axis << "] must be " << size << ", got " << t.size(axis);
}
inline void check_same_device(const TensorView& a, const TensorView& b, const char* an, const char* bn) {
  TVM_FFI_CHECK(a.device().device_type == b.device().device_type && a.device().device_id == b.device().device_id,
                ValueError)
      << an << " and " << bn << " must be on the same device";
}
inline void check_device_type(const TensorView& t, DLDeviceType want, const char* name) {
  TVM_FFI_CHECK(t.device().device_type == want, ValueError)
      << name << " is on the wrong device type for this backend (" << t.device().device_type << ")";
}
// An int64 contiguous 1-D or N-D tensor, on `ref`'s device.
inline void check_host_memory(const TensorView& t, const char* name) {
  TVM_FFI_CHECK(t.device().device_type == kDLCPU || t.device().device_type == kDLCUDAHost, ValueError)
      << name << " must be host memory";
}

inline void check_i64_tensor(const TensorView& t, const TensorView& ref, int ndim, const char* name,
                             const char* ref_name) {
  check_i64(t, name);
  check_ndim(t, ndim, name);
  check_contiguous(t, name);
  check_same_device(t, ref, name, ref_name);
}

// A slot table: int32 or int64 [R, L], contiguous, on `ref`'s device.
inline void check_slot_table(const TensorView& t, const TensorView& ref, const char* name, const char* ref_name) {
  check_index_dtype(t, name);
  check_ndim(t, 2, name);
  check_contiguous(t, name);
  check_same_device(t, ref, name, ref_name);
}
// The accessor over a checked slot table of `page` slots per entry (page >= 1; the logical row length
// stride * page must not overflow).
inline SlotTable slot_table_of(const TensorView& t, int64_t page, const char* name) {
  TVM_FFI_CHECK(page >= 1, ValueError) << name << ": page size must be >= 1, got " << page;
  const int64_t stride = t.size(1);
  TVM_FFI_CHECK(stride <= (int64_t{1} << 40) / page, ValueError)
      << name << ": " << stride << " entries x page " << page << " exceed the position range";
  return SlotTable{t.data_ptr(), is_i32(t), t.size(0), stride * page, stride, page};
}
// A plan int64 [cap, NUM_PLAN_COLS] and its status int64 [NUM_PLAN_STATUS_COLS], on `ref`'s device.
inline void check_plan_status(const TensorView& plan, const TensorView& status, const TensorView& ref,
                              const char* ref_name) {
  check_i64_tensor(plan, ref, 2, "plan", ref_name);
  check_dim(plan, 1, kNumPlanCols, "plan");
  check_i64_tensor(status, ref, 1, "status", ref_name);
  check_dim(status, 0, kNumPlanStatusCols, "status");
}
// Per-chain int64 [n] arrays on `ref`'s device: `first` fixes n (returned), every array of `rest` must match it.
inline int64_t check_chain_arrays(const TensorView& ref, const char* ref_name, const TensorView& first,
                                  const char* first_name,
                                  std::initializer_list<std::pair<const TensorView*, const char*>> rest) {
  check_i64_tensor(first, ref, 1, first_name, ref_name);
  const int64_t n = first.size(0);
  for (auto [t, name] : rest) {
    check_i64_tensor(*t, ref, 1, name, ref_name);
    check_dim(*t, 0, n, name);
  }
  return n;
}
// An optional int64 [n] argument: present (flag non-zero) with n entries, or a 0-element tensor.
inline void check_optional(const TensorView& t, int64_t present, const TensorView& ref, int64_t n, const char* name,
                           const char* ref_name) {
  check_i64_tensor(t, ref, 1, name, ref_name);
  if (present) {
    check_dim(t, 0, n, name);
  } else {
    TVM_FFI_CHECK(t.size(0) == 0, ValueError) << name << " must be empty when absent";
  }
}
// A plan and status an op fills (check_plan_status) with room for `needed` segments.
inline void check_plan_out(const TensorView& plan, const TensorView& status, const TensorView& ref,
                           const char* ref_name, int64_t needed) {
  check_plan_status(plan, status, ref, ref_name);
  TVM_FFI_CHECK(plan.size(0) >= needed, ValueError)
      << "plan has " << plan.size(0) << " rows, needs at least " << needed;
}
// The sink: ring rows [cap, NUM_VIOLATION_COLS], ring count [1], counters [NUM_LAUNCH_TAGS, NUM_COUNTER_COLS],
// step [1].
inline void check_sink(const TensorView& ring_rows, const TensorView& ring_count, const TensorView& counters,
                       const TensorView& step, const TensorView& ref, const char* ref_name) {
  check_i64_tensor(ring_rows, ref, 2, "ring_rows", ref_name);
  check_dim(ring_rows, 1, kNumViolationCols, "ring_rows");
  check_i64_tensor(ring_count, ref, 1, "ring_count", ref_name);
  check_dim(ring_count, 0, 1, "ring_count");
  check_i64_tensor(counters, ref, 2, "counters", ref_name);
  check_dim(counters, 0, kNumLaunchTags, "counters");
  check_dim(counters, 1, kNumCounterCols, "counters");
  check_i64_tensor(step, ref, 1, "step", ref_name);
  check_dim(step, 0, 1, "step");
}

// fingerprint op: table int64 [H, n, NUM_FP_SOURCE_COLS], half < H, a FingerprintMode, stride >= 1, and slots,
// positions, out int64 [N] on the table's device; returns N.
inline int64_t check_fingerprint_args(DLDeviceType device, const TensorView& table, int64_t half,
                                      const TensorView& slots, const TensorView& positions, int64_t mode,
                                      int64_t layer_stride, int64_t num_slots, const TensorView& out) {
  check_i64(table, "fp_table");
  check_contiguous(table, "fp_table");
  check_device_type(table, device, "fp_table");
  TVM_FFI_CHECK(table.ndim() == 3 && table.size(2) == kNumFpSourceCols, ValueError)
      << "fp_table must be [H, n, " << kNumFpSourceCols << "]";
  TVM_FFI_CHECK(half >= 0 && half < table.size(0), ValueError) << "half " << half << " outside the fp_table";
  TVM_FFI_CHECK(mode >= static_cast<int64_t>(FingerprintMode::NONE) &&
                    mode <= static_cast<int64_t>(FingerprintMode::ALL),
                ValueError)
      << "fingerprint mode " << mode << " is not a FingerprintMode";
  TVM_FFI_CHECK(layer_stride >= 1, ValueError) << "layer_stride must be >= 1, got " << layer_stride;
  check_i64_tensor(slots, table, 1, "slots", "fp_table");
  check_i64_tensor(positions, table, 1, "positions", "fp_table");
  check_i64_tensor(out, table, 1, "out", "fp_table");
  const int64_t n = slots.size(0);
  check_dim(positions, 0, n, "positions");
  check_dim(out, 0, n, "out");
  TVM_FFI_CHECK(num_slots >= 0, ValueError) << "num_slots must be >= 0";
  return n;
}

// bookkeep: counter int64 [k], acc and src int64 [n], contiguous, on the backend's device.
inline void check_bookkeep_args(DLDeviceType device, const TensorView& counter, const TensorView& acc,
                                const TensorView& src, const TensorView& mirror_src, const TensorView& mirror) {
  check_i64_tensor(counter, counter, 1, "counter", "counter");
  check_device_type(counter, device, "counter");
  check_i64_tensor(acc, counter, 1, "acc", "counter");
  check_i64_tensor(src, counter, 1, "src", "counter");
  check_dim(src, 0, acc.size(0), "src");
  check_i64_tensor(mirror_src, counter, 1, "mirror_src", "counter");
  check_i64(mirror, "mirror");
  check_ndim(mirror, 1, "mirror");
  check_contiguous(mirror, "mirror");
  check_host_memory(mirror, "mirror");
  TVM_FFI_CHECK(mirror.size(0) == (mirror_src.size(0) > 0 ? mirror_src.size(0) + 1 : 0), ValueError)
      << "mirror must have mirror_src's length + 1 entries (0 without a mirror), got " << mirror.size(0);
  TVM_FFI_CHECK(mirror_src.size(0) == 0 || counter.size(0) > 0, ValueError) << "a mirror needs a counter to tag it";
}

// scatter_tokens: pool_tokens int64 [R, L], pool_lens [R], rows/starts/counts [n], tokens [T], status [1], one device.
inline void check_scatter_args(DLDeviceType device, const TensorView& pool_tokens, const TensorView& pool_lens,
                               const TensorView& rows, const TensorView& starts, const TensorView& counts,
                               const TensorView& tokens, const TensorView& status) {
  check_i64_tensor(pool_tokens, pool_tokens, 2, "pool_tokens", "pool_tokens");
  check_device_type(pool_tokens, device, "pool_tokens");
  check_i64_tensor(pool_lens, pool_tokens, 1, "pool_lens", "pool_tokens");
  check_i64_tensor(rows, pool_tokens, 1, "rows", "pool_tokens");
  check_i64_tensor(starts, pool_tokens, 1, "starts", "pool_tokens");
  check_i64_tensor(counts, pool_tokens, 1, "counts", "pool_tokens");
  check_i64_tensor(tokens, pool_tokens, 1, "tokens", "pool_tokens");
  check_i64_tensor(status, pool_tokens, 1, "status", "pool_tokens");
  check_dim(pool_lens, 0, pool_tokens.size(0), "pool_lens");
  check_dim(starts, 0, rows.size(0), "starts");
  check_dim(counts, 0, rows.size(0), "counts");
  check_dim(status, 0, 1, "status");
}

// stage_batch (docs/ops-contract.md 8b): rows int64 [3, RC], truth int64 [U, RC], tokens int64 [3, TC] on `device`;
// the six batch arrays int32/int64 1-D on their device ([bs] x 3, [nt] x 3); staging int64 [U, >= bs] in host memory;
// bs <= pad_rows <= RC, nt <= pad_tokens <= TC. Returns the arguments (staging: its host address).
inline StageArgs check_stage_args(DLDeviceType device, const TensorView (&src)[6], const TensorView& staging,
                                  const TensorView& rows, const TensorView& truth, const TensorView& tokens,
                                  int64_t pad_rows, int64_t pad_tokens, int64_t padding_row) {
  static const char* const names[6] = {"req_pool_indices", "prefix_lens", "extend_lens",
                                       "input_ids",        "positions",   "out_cache_loc"};
  check_i64_tensor(rows, rows, 2, "rows", "rows");
  check_device_type(rows, device, "rows");
  check_dim(rows, 0, 3, "rows");
  check_i64_tensor(truth, rows, 2, "truth", "rows");
  check_dim(truth, 1, rows.size(1), "truth");
  check_i64_tensor(tokens, rows, 2, "tokens", "rows");
  check_dim(tokens, 0, 3, "tokens");
  StageArgs a{};
  for (int i = 0; i < 6; ++i) {
    check_index_dtype(src[i], names[i]);
    check_ndim(src[i], 1, names[i]);
    check_contiguous(src[i], names[i]);
    check_same_device(src[i], rows, names[i], "rows");
    check_dim(src[i], 0, src[i < 3 ? 0 : 3].size(0), names[i]);
    a.src[i] = src[i].data_ptr();
    a.src_i32[i] = is_i32(src[i]);
  }
  a.bs = src[0].size(0);
  a.nt = src[3].size(0);
  check_i64(staging, "staging");
  check_ndim(staging, 2, "staging");
  check_contiguous(staging, "staging");
  check_host_memory(staging, "staging");
  check_dim(staging, 0, truth.size(0), "staging");
  TVM_FFI_CHECK(staging.size(1) >= a.bs, ValueError)
      << "staging has " << staging.size(1) << " columns, the batch has " << a.bs << " rows";
  a.row_cap = rows.size(1);
  a.token_cap = tokens.size(1);
  TVM_FFI_CHECK(a.bs <= pad_rows && pad_rows <= a.row_cap, ValueError)
      << "pad_rows must lie in [" << a.bs << ", " << a.row_cap << "], got " << pad_rows;
  TVM_FFI_CHECK(a.nt <= pad_tokens && pad_tokens <= a.token_cap, ValueError)
      << "pad_tokens must lie in [" << a.nt << ", " << a.token_cap << "], got " << pad_tokens;
  a.staging = static_cast<const int64_t*>(staging.data_ptr());
  a.staging_cols = staging.size(1);
  a.rows = static_cast<int64_t*>(rows.data_ptr());
  a.truth = static_cast<int64_t*>(truth.data_ptr());
  a.tokens = static_cast<int64_t*>(tokens.data_ptr());
  a.U = truth.size(0);
  a.pad_rows = pad_rows;
  a.pad_tokens = pad_tokens;
  a.padding_row = padding_row;
  return a;
}

}  // namespace kvcanary
