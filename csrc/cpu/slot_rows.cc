// CPU entry point of the slot-row fill (docs/ops-contract.md 12).
//
// Native signature (kvcanary_cpu and kvcanary_cuda export the same):
//   slot_rows(table: int32|int64 [R, L], rows, starts, lens: int64 [bs], src: int32|int64 [m], out: int64 [n],
//             write: int32|int64 [n], stride: int, page: int) -> None
//   table[rows[i], j] = slot(src[starts[i] + j]) for j < min(lens[i], L) (requests outside the table or src: none),
//   out[k] = slot(write[k]); slot(s) = s - (s // stride) * (stride - page) when s >= 0 and s % stride < page, else
//   NO_SLOT (and NO_SLOT for a slot an int32 table cannot hold).
#include <tvm/ffi/function.h>

#include "core/slot_rows.h"

namespace kvcanary {

void slot_rows(TensorView table, TensorView rows, TensorView starts, TensorView lens, TensorView src, TensorView out,
               TensorView write, int64_t stride, int64_t page) {
  const SlotRowsArgs a = check_slot_rows_args(kDLCPU, table, rows, starts, lens, src, out, write, stride, page);
  const auto* r = static_cast<const int64_t*>(rows.data_ptr());
  const auto* st = static_cast<const int64_t*>(starts.data_ptr());
  const auto* ln = static_cast<const int64_t*>(lens.data_ptr());
  const IndexVec from{src.data_ptr(), is_i32(src)}, wr{write.data_ptr(), is_i32(write)};
  const bool t32 = is_i32(table);
  for (int64_t i = 0; i < a.bs; ++i) {
    const int64_t k = filled_positions(r[i], st[i], ln[i], a);
    for (int64_t j = 0; j < k; ++j) fill_slot(table.data_ptr(), t32, r[i], j, from[st[i] + j], a);
  }
  auto* o = static_cast<int64_t*>(out.data_ptr());
  for (int64_t k = 0; k < a.n; ++k) o[k] = table_slot(wr[k], stride, page);
}

}  // namespace kvcanary

TVM_FFI_DLL_EXPORT_TYPED_FUNC(slot_rows, kvcanary::slot_rows);
