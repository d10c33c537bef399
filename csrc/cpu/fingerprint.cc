// CPU entry point of the fingerprint op (docs/ops-contract.md 1).
//
// Native signature (kvcanary_cpu and kvcanary_cuda export the same):
//   fingerprint(table: int64 [H, n, NUM_FP_SOURCE_COLS], half: int64, slots: int64 [N], positions: int64 [N],
//               mode: int64 (FingerprintMode), layer_stride: int64 (>= 1), num_slots: int64, out: int64 [N]) -> None
//   out[i] = fingerprint of group slot slots[i] at positions[i] for `half`; 0 when mode == NONE or when
//   slots[i] is outside [0, num_slots) or positions[i] outside [0, TOKEN_LIMIT) (never read).
#include <tvm/ffi/function.h>

#include "core/fingerprint.cuh"
#include "core/tensor_checks.h"

namespace kvcanary {

void fingerprint(TensorView table, int64_t half, TensorView slots, TensorView positions, int64_t mode,
                 int64_t layer_stride, int64_t num_slots, TensorView out) {
  const int64_t n = check_fingerprint_args(kDLCPU, table, half, slots, positions, mode, layer_stride, num_slots, out);
  const auto* s = static_cast<const int64_t*>(slots.data_ptr());
  const auto* p = static_cast<const int64_t*>(positions.data_ptr());
  auto* o = static_cast<int64_t*>(out.data_ptr());
  const auto* tab = static_cast<const int64_t*>(table.data_ptr());
  const int64_t n_sources = table.size(1);
  for (int64_t i = 0; i < n; ++i) {
    const bool ok = mode != static_cast<int64_t>(FingerprintMode::NONE) && s[i] >= 0 && s[i] < num_slots &&
                    chain_value_ok(p[i]);
    o[i] = ok ? static_cast<int64_t>(fingerprint_serial(tab, n_sources, half, s[i], p[i], static_cast<int32_t>(mode),
                                                        layer_stride))
              : 0;
  }
}

}  // namespace kvcanary

TVM_FFI_DLL_EXPORT_TYPED_FUNC(fingerprint, kvcanary::fingerprint);
