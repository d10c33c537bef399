// CPU entry point of the slot-row fill (docs/ops-contract.md 12).
//
// Native signature (kvcanary_cpu and kvcanary_cuda export the same):
//   slot_rows(table: int32|int64 [R, L], rows, starts, lens: int64 [bs], src: int32|int64 [m], out: int64 [n],
//             write: int32|int64 [n], stride: int, page: int) -> None
//   table[rows[i], j] = slot(src[starts[i] + j]) for j < min(lens[i], L) (requests outside the table or src: none),
//   out[k] = slot(write[k]); slot(s) = s - (s // stride) * (stride - page) when s >= 0 and s % stride < page, else
//   NO_SLOT (and NO_SLOT for a slot an int32 table cannot hold).
//   stage_slot_rows(table, facts_in: int64 [3, bs] host, staging: int64 [5, W] host, facts: int64 [5, W] (may be
//                   staging), src, out, write, stride, page, event: 0) -> None
//   staging[:, :bs] = facts[:, :bs] = (rows, prefix, extend, kv, starts) of facts_in, then slot_rows from them.
#include <tvm/ffi/function.h>

#include <cstring>

#include "core/slot_rows.h"

namespace kvcanary {
namespace {

void fill_rows(const TensorView& table, const int64_t* r, const int64_t* st, const int64_t* ln, const TensorView& src,
               const TensorView& out, const TensorView& write, const SlotRowsArgs& a) {
  const IndexVec from{src.data_ptr(), is_i32(src)}, wr{write.data_ptr(), is_i32(write)};
  const bool t32 = is_i32(table);
  for (int64_t i = 0; i < a.bs; ++i) {
    const int64_t k = filled_positions(r[i], st[i], ln[i], a);
    for (int64_t j = 0; j < k; ++j) fill_slot(table.data_ptr(), t32, r[i], j, from[st[i] + j], a);
  }
  auto* o = static_cast<int64_t*>(out.data_ptr());
  for (int64_t k = 0; k < a.n; ++k) o[k] = table_slot(wr[k], a.stride, a.page);
}

}  // namespace

void slot_rows(TensorView table, TensorView rows, TensorView starts, TensorView lens, TensorView src, TensorView out,
               TensorView write, int64_t stride, int64_t page) {
  const SlotRowsArgs a = check_slot_rows_args(kDLCPU, table, rows, starts, lens, src, out, write, stride, page);
  fill_rows(table, static_cast<const int64_t*>(rows.data_ptr()), static_cast<const int64_t*>(starts.data_ptr()),
            static_cast<const int64_t*>(lens.data_ptr()), src, out, write, a);
}

void stage_slot_rows(TensorView table, TensorView facts_in, TensorView staging, TensorView facts, TensorView src,
                     TensorView out, TensorView write, int64_t stride, int64_t page, int64_t event) {
  const StageSlotRowsArgs s =
      check_stage_slot_rows_args(kDLCPU, table, facts_in, staging, facts, src, out, write, stride, page);
  TVM_FFI_CHECK(event == 0, ValueError) << "stage_slot_rows: event must be 0 off the CUDA backend";
  const int64_t bs = s.a.bs, w = s.width;
  stage_facts(s.in, bs, s.staging, w);
  if (s.facts != s.staging) {
    for (int64_t r = 0; r < kSlotFactRows; ++r) std::memmove(s.facts + r * w, s.staging + r * w, bs * sizeof(int64_t));
  }
  fill_rows(table, s.facts + kFactRow * w, s.facts + kFactStart * w, s.facts + kFactKv * w, src, out, write, s.a);
}

}  // namespace kvcanary

TVM_FFI_DLL_EXPORT_TYPED_FUNC(slot_rows, kvcanary::slot_rows);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(stage_slot_rows, kvcanary::stage_slot_rows);
