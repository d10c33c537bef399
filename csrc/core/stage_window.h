// stage_window (docs/ops-contract.md 13): a reporting window's head and kept violation rows copied into a host
// snapshot, the window's counts reset, the snapshot tagged last. The argument checks both modules share.
#pragma once

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>

#include <cstdint>
#include <utility>

#include "tensor_checks.h"

namespace kvcanary {

struct WindowArgs {
  int64_t h, cap, cols, r;
};

// The violation rows a window keeps: its ring count clamped to [0, cap].
KVC_HD int64_t kept_rows(int64_t count, int64_t cap) { return count < 0 ? 0 : count < cap ? count : cap; }

// Whether two tensors' bytes overlap (both contiguous).
inline bool overlaps(const TensorView& a, const TensorView& b) {
  const auto* pa = static_cast<const char*>(a.data_ptr());
  const auto* pb = static_cast<const char*>(b.data_ptr());
  return a.numel() > 0 && b.numel() > 0 && pa < pb + b.numel() * 8 && pb < pa + a.numel() * 8;
}

// head int64 [h], count int64 [1], rows int64 [cap, c], reset int64 [r], all contiguous on `device`'s type and on
// head's device; dst int64 [1 + h + cap * c] contiguous host memory overlapping none of them.
inline WindowArgs check_stage_window_args(DLDeviceType device, const TensorView& head, const TensorView& count,
                                          const TensorView& rows, const TensorView& reset, const TensorView& dst) {
  check_i64_tensor(head, head, 1, "head", "head");
  check_device_type(head, device, "head");
  check_i64_tensor(count, head, 1, "count", "head");
  check_dim(count, 0, 1, "count");
  check_i64_tensor(rows, head, 2, "rows", "head");
  check_i64_tensor(reset, head, 1, "reset", "head");
  check_i64(dst, "dst");
  check_ndim(dst, 1, "dst");
  check_contiguous(dst, "dst");
  check_host_memory(dst, "dst");
  const WindowArgs a{head.size(0), rows.size(0), rows.size(1), reset.size(0)};
  check_dim(dst, 0, 1 + a.h + a.cap * a.cols, "dst");
  for (const auto& [t, name] : {std::pair<const TensorView&, const char*>{head, "head"}, {count, "count"},
                                {rows, "rows"}, {reset, "reset"}}) {
    TVM_FFI_CHECK(device != kDLCPU || !overlaps(dst, t), ValueError) << "dst must not overlap " << name;
  }
  return a;
}

}  // namespace kvcanary
