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

// Host checks shared with the CUDA entry: table shape, half, mode, stride.
inline void check_fp_args(const TensorView& table, int64_t half, int64_t mode, int64_t layer_stride) {
  check_i64(table, "fp_table");
  check_contiguous(table, "fp_table");
  TVM_FFI_CHECK(table.ndim() == 3 && table.size(2) == kNumFpSourceCols, ValueError)
      << "fp_table must be [H, n, " << kNumFpSourceCols << "]";
  TVM_FFI_CHECK(half >= 0 && half < table.size(0), ValueError) << "half " << half << " outside the fp_table";
  TVM_FFI_CHECK(mode >= static_cast<int64_t>(FingerprintMode::NONE) && mode <= static_cast<int64_t>(FingerprintMode::ALL),
                ValueError)
      << "fingerprint mode " << mode << " is not a FingerprintMode";
  TVM_FFI_CHECK(layer_stride >= 1, ValueError) << "layer_stride must be >= 1, got " << layer_stride;
}

void fingerprint(TensorView table, int64_t half, TensorView slots, TensorView positions, int64_t mode,
                 int64_t layer_stride, int64_t num_slots, TensorView out) {
  check_fp_args(table, half, mode, layer_stride);
  check_device_type(table, kDLCPU, "fp_table");
  check_i64_tensor(slots, table, 1, "slots", "fp_table");
  check_i64_tensor(positions, table, 1, "positions", "fp_table");
  check_i64_tensor(out, table, 1, "out", "fp_table");
  const int64_t n = slots.size(0);
  check_dim(positions, 0, n, "positions");
  check_dim(out, 0, n, "out");
  TVM_FFI_CHECK(num_slots >= 0, ValueError) << "num_slots must be >= 0";
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
