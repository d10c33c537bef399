// CPU entry point of the per-stage bookkeeping (docs/ops-contract.md 10).
//
// Native signature (kvcanary_cpu and kvcanary_cuda export the same):
//   bookkeep(counter: int64 [k], acc: int64 [n], src: int64 [n], mirror_src: int64 [m], mirror: int64 [m + 1 or 0],
//            host) -> None
//   counter[j] += 1 for every j; acc[i] = max(acc[i], src[i]); then, with a mirror, mirror[1 + i] = mirror_src[i] and
//   last mirror[0] = counter[0] (the tag that says which stage's values the host reads).
#include <tvm/ffi/function.h>

#include <algorithm>

#include "core/common.cuh"
#include "core/tensor_checks.h"

namespace kvcanary {

void bookkeep(TensorView counter, TensorView acc, TensorView src, TensorView mirror_src, TensorView mirror) {
  check_bookkeep_args(kDLCPU, counter, acc, src, mirror_src, mirror);
  int64_t* c = static_cast<int64_t*>(counter.data_ptr());
  for (int64_t j = 0; j < counter.size(0); ++j) ++c[j];
  int64_t* a = static_cast<int64_t*>(acc.data_ptr());
  const int64_t* s = static_cast<const int64_t*>(src.data_ptr());
  for (int64_t i = 0; i < acc.size(0); ++i) a[i] = std::max(a[i], s[i]);
  const int64_t m = mirror_src.size(0);
  if (m == 0) return;
  int64_t* out = static_cast<int64_t*>(mirror.data_ptr());
  const int64_t* ms = static_cast<const int64_t*>(mirror_src.data_ptr());
  for (int64_t i = 0; i < m; ++i) out[1 + i] = ms[i];
  out[0] = c[0];
}

}  // namespace kvcanary

TVM_FFI_DLL_EXPORT_TYPED_FUNC(bookkeep, kvcanary::bookkeep);
