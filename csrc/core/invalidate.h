// invalidate (docs/ops-contract.md 11): the argument checks and the host slot filter both modules share, and the
// record a freed slot gets.
#pragma once

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>

#include <cstdint>

#include "tensor_checks.h"

namespace kvcanary {

// No planned position is negative, so a later verify of a poisoned slot reports VERIFY_POSITION, and its zero chain
// value fails the chain check of the slot after it.
KVC_HD CanaryRecord poisoned_record() { return CanaryRecord{0, NO_SLOT, 0, 0}; }

// records int64 [B, S, H, RECORD_BYTES / 8] (B >= 1 buffers, e.g. HEAD and TAIL; H in {1, 2}) on `device`, contiguous;
// slots int32/int64 [n], contiguous, on the records' device, or (`host_slots_ok`: the CUDA module) in host memory;
// 0 <= reserved <= S. Returns whether the slots lie in host memory.
inline bool check_invalidate_args(DLDeviceType device, const TensorView& records, const TensorView& slots,
                                  int64_t reserved, bool host_slots_ok) {
  check_i64_tensor(records, records, 4, "records", "records");
  check_device_type(records, device, "records");
  TVM_FFI_CHECK(records.size(0) >= 1, ValueError) << "records must hold at least one buffer";
  TVM_FFI_CHECK(records.size(2) == 1 || records.size(2) == MAX_HALVES, ValueError)
      << "records.shape[2] must be 1 or 2, got " << records.size(2);
  check_dim(records, 3, static_cast<int64_t>(sizeof(CanaryRecord) / sizeof(int64_t)), "records");
  TVM_FFI_CHECK(reserved >= 0 && reserved <= records.size(1), ValueError)
      << "reserved must be in [0, " << records.size(1) << "], got " << reserved;
  check_index_dtype(slots, "slots");
  check_ndim(slots, 1, "slots");
  check_contiguous(slots, "slots");
  const bool host = device != kDLCPU && (slots.device().device_type == kDLCPU ||
                                         slots.device().device_type == kDLCUDAHost);
  if (!(host && host_slots_ok)) check_same_device(slots, records, "slots", "records");
  return host;
}

// Calls keep(s) for every slot id of a host list in [reserved, num_slots), in order; the others are left alone.
template <typename Keep>
inline void for_each_kept_slot(const TensorView& slots, int64_t reserved, int64_t num_slots, Keep keep) {
  const int64_t n = slots.size(0);
  if (is_i64(slots)) {
    const auto* s = static_cast<const int64_t*>(slots.data_ptr());
    for (int64_t i = 0; i < n; ++i)
      if (s[i] >= reserved && s[i] < num_slots) keep(s[i]);
  } else {
    const auto* s = static_cast<const int32_t*>(slots.data_ptr());
    for (int64_t i = 0; i < n; ++i)
      if (s[i] >= reserved && s[i] < num_slots) keep(static_cast<int64_t>(s[i]));
  }
}

}  // namespace kvcanary
