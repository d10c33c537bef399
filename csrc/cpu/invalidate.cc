// CPU entry point of the freed-slot invalidation (docs/ops-contract.md 11).
//
// Native signature (kvcanary_cpu and kvcanary_cuda export the same):
//   invalidate(records: int64 [B, S, H, RECORD_BYTES / 8], slots: int32|int64 [n], reserved: int) -> None
//   Every slot id s of `slots` in [reserved, S) gets the poisoned record (every field 0, position NO_SLOT) in every
//   buffer and half; other ids (reserved slots, ids outside the pool) are left alone.
#include <tvm/ffi/function.h>

#include "core/invalidate.h"

namespace kvcanary {

void invalidate(TensorView records, TensorView slots, int64_t reserved) {
  check_invalidate_args(kDLCPU, records, slots, reserved, false);
  const int64_t B = records.size(0), S = records.size(1), H = records.size(2);
  auto* rec = static_cast<CanaryRecord*>(records.data_ptr());
  for_each_kept_slot(slots, reserved, S, [&](int64_t s) {
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h) rec[(b * S + s) * H + h] = poisoned_record();
  });
}

}  // namespace kvcanary

TVM_FFI_DLL_EXPORT_TYPED_FUNC(invalidate, kvcanary::invalidate);
