// CPU entry point of the expected-token pool append (docs/ops-contract.md 7).
//
// Native signature (kvcanary_cpu and kvcanary_cuda export the same):
//   scatter_tokens(pool_tokens: int64 [R, L], pool_lens: int64 [R], rows: int64 [n], starts: int64 [n],
//                  counts: int64 [n], tokens: int64 [T], status: int64 [1]) -> None
//   Request i takes tokens[off_i : off_i + counts[i]], off_i = sum over k < i of clamp(counts[k], 0, T + 1) (a negative
//   count advances nothing); it writes pool_tokens[rows[i], starts[i] : starts[i] + counts[i]] and sets
//   pool_lens[rows[i]] = starts[i] + counts[i]. Invalid requests (row outside [0, R), start < 0, count < 0,
//   start + count > L, off + count > T) are skipped and status[0] += 1 each.
#include <tvm/ffi/function.h>

#include "core/common.cuh"
#include "core/tensor_checks.h"

namespace kvcanary {

void scatter_tokens(TensorView pool_tokens, TensorView pool_lens, TensorView rows, TensorView starts,
                    TensorView counts, TensorView tokens, TensorView status) {
  check_scatter_args(kDLCPU, pool_tokens, pool_lens, rows, starts, counts, tokens, status);
  const int64_t R = pool_tokens.size(0), L = pool_tokens.size(1), n = rows.size(0), T = tokens.size(0);
  auto* pool = static_cast<int64_t*>(pool_tokens.data_ptr());
  auto* lens = static_cast<int64_t*>(pool_lens.data_ptr());
  const auto* r = static_cast<const int64_t*>(rows.data_ptr());
  const auto* st = static_cast<const int64_t*>(starts.data_ptr());
  const auto* c = static_cast<const int64_t*>(counts.data_ptr());
  const auto* tok = static_cast<const int64_t*>(tokens.data_ptr());
  int64_t off = 0, errors = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = r[i], start = st[i], cnt = c[i];
    const bool ok = row >= 0 && row < R && start >= 0 && cnt >= 0 && start <= L && cnt <= L - start && off <= T &&
                    cnt <= T - off;
    if (ok) {
      for (int64_t k = 0; k < cnt; ++k) pool[row * L + start + k] = tok[off + k];
      lens[row] = start + cnt;
    } else {
      ++errors;
    }
    if (cnt > 0) off += cnt < T + 1 ? cnt : T + 1;  // saturating: once off > T every later count > 0 fails
  }
  static_cast<int64_t*>(status.data_ptr())[0] += errors;
}

}  // namespace kvcanary

TVM_FFI_DLL_EXPORT_TYPED_FUNC(scatter_tokens, kvcanary::scatter_tokens);
