// slot_rows (docs/ops-contract.md 12): an engine's per-request slot lists in another addressing (a flat list of read
// slots, one segment per request, and the write slots) converted to table-space slots and filled into slot-table rows.
// The argument checks and the conversion both modules share.
#pragma once

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>

#include <cstdint>
#include <limits>
#include <tuple>
#include <utility>

#include "tensor_checks.h"

namespace kvcanary {

// The table-space slot of engine slot `s`: blocks of `stride` rows hold `page` token slots each; rows past them (and
// negative ids) are no token slot. block * page + (s - block * stride), as s - block * (stride - page).
KVC_HD int64_t table_slot(int64_t s, int64_t stride, int64_t page) {
  if (s < 0) return NO_SLOT;
  const int64_t block = s / stride;
  return s - block * stride < page ? s - block * (stride - page) : NO_SLOT;
}

// A slot as the table's dtype stores it: NO_SLOT when it does not fit an int32 table.
KVC_HD int64_t storable_slot(int64_t s, bool i32) {
  return i32 && s > std::numeric_limits<int32_t>::max() ? NO_SLOT : s;
}

struct SlotRowsArgs {
  int64_t bs, R, L, m, n, stride, page;
};

// An int32 or int64 vector read as int64.
struct IndexVec {
  const void* p;
  bool i32;
  KVC_HD int64_t operator[](int64_t i) const {
    return i32 ? static_cast<const int32_t*>(p)[i] : static_cast<const int64_t*>(p)[i];
  }
};

// table int32/int64 [R, L]; src int32/int64 [m]; out int64 [n]; write int32/int64 [n]; every tensor contiguous on
// `device`'s type and on the table's device; 1 <= page <= stride. `bs`: the batch's request count.
inline SlotRowsArgs check_slot_table_args(DLDeviceType device, const TensorView& table, const TensorView& src,
                                          const TensorView& out, const TensorView& write, int64_t stride,
                                          int64_t page, int64_t bs) {
  check_slot_table(table, table, "table", "table");
  check_device_type(table, device, "table");
  check_i64_tensor(out, table, 1, "out", "table");
  for (const auto& [t, name] : {std::pair<const TensorView&, const char*>{src, "src"}, {write, "write"}}) {
    check_index_dtype(t, name);
    check_ndim(t, 1, name);
    check_contiguous(t, name);
    check_same_device(t, table, name, "table");
  }
  check_dim(write, 0, out.size(0), "write");
  TVM_FFI_CHECK(page >= 1 && stride >= page, ValueError)
      << "slot_rows needs 1 <= page <= stride, got page " << page << ", stride " << stride;
  return SlotRowsArgs{bs, table.size(0), table.size(1), src.size(0), out.size(0), stride, page};
}

// slot_rows: the table arguments above and rows, starts, lens int64 [bs] on the table's device.
inline SlotRowsArgs check_slot_rows_args(DLDeviceType device, const TensorView& table, const TensorView& rows,
                                         const TensorView& starts, const TensorView& lens, const TensorView& src,
                                         const TensorView& out, const TensorView& write, int64_t stride,
                                         int64_t page) {
  for (const auto& [t, name] : {std::pair<const TensorView&, const char*>{rows, "rows"}, {starts, "starts"},
                                {lens, "lens"}}) {
    check_i64_tensor(t, table, 1, name, "table");
  }
  const int64_t bs = rows.size(0);
  check_dim(starts, 0, bs, "starts");
  check_dim(lens, 0, bs, "lens");
  return check_slot_table_args(device, table, src, out, write, stride, page, bs);
}

// stage_slot_rows' staged rows (docs/ops-contract.md 12a): rows, prefix, extend, kv lengths, read starts.
constexpr int64_t kSlotFactRows = 5;
enum SlotFact : int64_t { kFactRow = 0, kFactPrefix = 1, kFactExtend = 2, kFactKv = 3, kFactStart = 4 };

// Whether a batch's facts `in` (int64 [3, bs]: rows, prefix lengths, extend lengths) keep every kv length (prefix +
// extend) and read start (the total included) within int64.
inline bool facts_fit(const int64_t* in, int64_t bs) {
  int64_t start = 0;
  for (int64_t i = 0; i < bs; ++i) {
    int64_t kv = 0, next = 0;
    if (__builtin_add_overflow(in[bs + i], in[2 * bs + i], &kv) || __builtin_add_overflow(start, kv, &next)) {
      return false;
    }
    start = next;
  }
  return true;
}

// The five staged rows of facts that fit (facts_fit, checked with the arguments): kv = prefix + extend, start = the
// exclusive prefix sum of kv, written to `out` (row pitch `pitch`).
inline void stage_facts(const int64_t* in, int64_t bs, int64_t* out, int64_t pitch) {
  int64_t start = 0;
  for (int64_t i = 0; i < bs; ++i) {
    const int64_t kv = in[bs + i] + in[2 * bs + i];
    for (int64_t r = 0; r < 3; ++r) out[r * pitch + i] = in[r * bs + i];
    out[kFactKv * pitch + i] = kv;
    out[kFactStart * pitch + i] = start;
    start += kv;
  }
}

struct StageSlotRowsArgs {
  SlotRowsArgs a;
  const int64_t* in;  // [3, bs]
  int64_t *staging, *facts;  // [kSlotFactRows, width] each
  int64_t width;
};

// stage_slot_rows: the table arguments of slot_rows; facts_in int64 [3, bs] and staging int64 [5, W >= bs], host
// memory, contiguous; facts int64 [5, W] contiguous on the table's device (it may be staging itself); the batch's
// sums within int64.
inline StageSlotRowsArgs check_stage_slot_rows_args(DLDeviceType device, const TensorView& table,
                                                    const TensorView& facts_in, const TensorView& staging,
                                                    const TensorView& facts, const TensorView& src,
                                                    const TensorView& out, const TensorView& write, int64_t stride,
                                                    int64_t page) {
  for (const auto& [t, name, rows] : {std::tuple<const TensorView&, const char*, int64_t>{facts_in, "facts_in", 3},
                                      {staging, "staging", kSlotFactRows}}) {
    check_i64(t, name);
    check_ndim(t, 2, name);
    check_contiguous(t, name);
    check_host_memory(t, name);
    check_dim(t, 0, rows, name);
  }
  check_i64_tensor(facts, table, 2, "facts", "table");
  check_dim(facts, 0, kSlotFactRows, "facts");
  check_dim(facts, 1, staging.size(1), "facts");
  const int64_t bs = facts_in.size(1);
  TVM_FFI_CHECK(bs <= staging.size(1), ValueError)
      << "staging has " << staging.size(1) << " columns, the batch has " << bs << " requests";
  const auto* in = static_cast<const int64_t*>(facts_in.data_ptr());
  TVM_FFI_CHECK(facts_fit(in, bs), ValueError)
      << "stage_slot_rows: a kv length (prefix + extend) or read start leaves int64";
  return StageSlotRowsArgs{check_slot_table_args(device, table, src, out, write, stride, page, bs), in,
                           static_cast<int64_t*>(staging.data_ptr()), static_cast<int64_t*>(facts.data_ptr()),
                           staging.size(1)};
}

// The positions of request i that get filled: [0, min(len, L)) of a request whose row lies in the table and whose
// segment [start, start + len) lies in src; 0 for any other request (the plan reports its row or lengths).
KVC_HD int64_t filled_positions(int64_t row, int64_t start, int64_t len, const SlotRowsArgs& a) {
  if (row < 0 || row >= a.R || start < 0 || len < 0 || start > a.m || len > a.m - start) return 0;
  return len < a.L ? len : a.L;
}

// Position j of request i: table[row, j] = the table slot of src[start + j], as the table stores it.
KVC_HD void fill_slot(void* table, bool t32, int64_t row, int64_t j, int64_t s, const SlotRowsArgs& a) {
  const int64_t v = storable_slot(table_slot(s, a.stride, a.page), t32);
  if (t32) {
    static_cast<int32_t*>(table)[row * a.L + j] = static_cast<int32_t>(v);
  } else {
    static_cast<int64_t*>(table)[row * a.L + j] = v;
  }
}

}  // namespace kvcanary
