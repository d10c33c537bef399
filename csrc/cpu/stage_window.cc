// CPU entry point of the window staging (docs/ops-contract.md 13).
//
// Native signature (kvcanary_cpu and kvcanary_cuda export the same):
//   stage_window(head: int64 [h], count: int64 [1], rows: int64 [cap, c], reset: int64 [r],
//                dst: int64 [1 + h + cap * c] (host), tag: int) -> None
//   dst[1:1+h] = head, dst[1+h : 1+h+k*c] = rows[:k] (k = count clamped to [0, cap]), reset[:] = 0, dst[0] = tag last.
#include <tvm/ffi/function.h>

#include <atomic>
#include <cstring>

#include "core/stage_window.h"

namespace kvcanary {

void stage_window(TensorView head, TensorView count, TensorView rows, TensorView reset, TensorView dst, int64_t tag) {
  const WindowArgs a = check_stage_window_args(kDLCPU, head, count, rows, reset, dst);
  auto* out = static_cast<int64_t*>(dst.data_ptr());
  const int64_t k = kept_rows(*static_cast<const int64_t*>(count.data_ptr()), a.cap);
  std::memcpy(out + 1, head.data_ptr(), static_cast<size_t>(a.h) * sizeof(int64_t));
  std::memcpy(out + 1 + a.h, rows.data_ptr(), static_cast<size_t>(k * a.cols) * sizeof(int64_t));
  std::memset(reset.data_ptr(), 0, static_cast<size_t>(a.r) * sizeof(int64_t));
  std::atomic_thread_fence(std::memory_order_release);  // a reader on another thread takes the tag first
  out[0] = tag;
}

}  // namespace kvcanary

TVM_FFI_DLL_EXPORT_TYPED_FUNC(stage_window, kvcanary::stage_window);
