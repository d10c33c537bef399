// CPU entry point of batch staging (docs/ops-contract.md 8b).
//
// Native signature (kvcanary_cpu and kvcanary_cuda export the same; begin_decode: docs/ops-contract.md 8c):
//   stage_batch(req_pool_indices, prefix_lens, extend_lens: int32/int64 [bs], input_ids, positions, out_cache_loc:
//               int32/int64 [nt], staging: int64 [U, >= bs] (host), rows: int64 [3, RC], truth: int64 [U, RC],
//               tokens: int64 [3, TC], pad_rows, pad_tokens, padding_row: int) -> None
//   rows[:, :bs] = the three row arrays, truth[:, :bs] = staging[:, :bs], tokens[:, :nt] = the three token arrays;
//   rows [bs, pad_rows) become padding rows (padding_row, 0, 0), tokens [nt, pad_tokens) get out_cache_loc -1.
#include <tvm/ffi/function.h>

#include "core/stage_batch.cuh"
#include "core/tensor_checks.h"
#include "core/truth_decode.h"

namespace kvcanary {
namespace {

void stage_all(const StageArgs& a) {
  for (int64_t i = 0; i < a.pad_rows; ++i) stage_row(a, i);
  for (int64_t k = 0; k < a.pad_tokens; ++k) stage_token(a, k);
}

}  // namespace

void stage_batch(TensorView req_pool_indices, TensorView prefix_lens, TensorView extend_lens, TensorView input_ids,
                 TensorView positions, TensorView out_cache_loc, TensorView staging, TensorView rows,
                 TensorView truth, TensorView tokens, int64_t pad_rows, int64_t pad_tokens, int64_t padding_row) {
  const TensorView src[6] = {req_pool_indices, prefix_lens, extend_lens, input_ids, positions, out_cache_loc};
  stage_all(check_stage_args(kDLCPU, src, staging, rows, truth, tokens, pad_rows, pad_tokens, padding_row));
}

// docs/ops-contract.md 8c: stage_batch's arguments, then the steady decode's host arrays (8a) and the staging event (0
// here: CUDA only); stages only after a steady decode (result >= 0).
int64_t begin_decode(TensorView req_pool_indices, TensorView prefix_lens, TensorView extend_lens,
                     TensorView input_ids, TensorView positions, TensorView out_cache_loc, TensorView staging,
                     TensorView rows, TensorView truth, TensorView tokens, int64_t pad_rows, int64_t pad_tokens,
                     int64_t padding_row, TensorView host_rows, TensorView host_pre, TensorView host_ext,
                     TensorView true_new, TensorView live, TensorView h, TensorView n, int64_t offset,
                     TensorView seen, TensorView prefix, int64_t step, TensorView reuse, int64_t event) {
  TVM_FFI_CHECK(event == 0, ValueError) << "event must be 0 on the CPU backend (a CUDA event guards pinned staging)";
  const TensorView src[6] = {req_pool_indices, prefix_lens, extend_lens, input_ids, positions, out_cache_loc};
  const StageArgs a = check_stage_args(kDLCPU, src, staging, rows, truth, tokens, pad_rows, pad_tokens, padding_row);
  const int64_t got = begin_decode_host(a, static_cast<int64_t*>(staging.data_ptr()), host_rows, host_pre, host_ext,
                                        true_new, live, h, n, offset, seen, prefix, step, reuse);
  if (got >= 0) stage_all(a);
  return got;
}

}  // namespace kvcanary

TVM_FFI_DLL_EXPORT_TYPED_FUNC(stage_batch, kvcanary::stage_batch);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(begin_decode, kvcanary::begin_decode);
