// CPU entry points of the hash functions (vectorized over tensors), the bulk token truth of a forward's continuing
// rows and the schema version.
#include <tvm/ffi/function.h>

#include "core/hash.cuh"
#include "core/tensor_checks.h"
#include "core/truth_decode.h"

namespace kvcanary {

int64_t schema_version() { return kSchemaVersion; }

// out[i] = splitmix64(x[i]).
void hash_splitmix64(TensorView x, TensorView out) {
  check_i64_tensor(x, x, 1, "x", "x");
  check_i64_tensor(out, x, 1, "out", "x");
  check_device_type(x, kDLCPU, "x");
  check_dim(out, 0, x.size(0), "out");
  const auto* in = static_cast<const uint64_t*>(x.data_ptr());
  auto* o = static_cast<uint64_t*>(out.data_ptr());
  for (int64_t i = 0; i < x.size(0); ++i) o[i] = splitmix64(in[i]);
}

// out[i] = h[i] * CHAIN_BASE + g(tokens[i], positions[i]); returns the count of out-of-range inputs (out = 0 there).
int64_t hash_chain_step(TensorView h, TensorView tokens, TensorView positions, TensorView out) {
  check_i64_tensor(h, h, 1, "h", "h");
  check_device_type(h, kDLCPU, "h");
  check_i64_tensor(tokens, h, 1, "tokens", "h");
  check_i64_tensor(positions, h, 1, "positions", "h");
  check_i64_tensor(out, h, 1, "out", "h");
  const int64_t n = h.size(0);
  check_dim(tokens, 0, n, "tokens");
  check_dim(positions, 0, n, "positions");
  check_dim(out, 0, n, "out");
  const auto* hv = static_cast<const uint64_t*>(h.data_ptr());
  const auto* tv = static_cast<const int64_t*>(tokens.data_ptr());
  const auto* pv = static_cast<const int64_t*>(positions.data_ptr());
  auto* o = static_cast<uint64_t*>(out.data_ptr());
  int64_t errors = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bool ok = chain_value_ok(tv[i]) && chain_value_ok(pv[i]);
    errors += ok ? 0 : 1;
    o[i] = ok ? chain_step(hv[i], tv[i], pv[i]) : 0;
  }
  return errors;
}

// The token truth of a forward's continuing rows (docs/ops-contract.md 8d); out int64 [4, >= bs], host memory.
int64_t truth_segments(TensorView rows, TensorView pre, TensorView ext, TensorView tokens, TensorView fast,
                       TensorView h, TensorView n, int64_t offset, TensorView out) {
  check_i64(out, "out");
  check_ndim(out, 2, "out");
  check_contiguous(out, "out");
  check_device_type(out, kDLCPU, "out");
  check_dim(out, 0, 4, "out");
  return segment_rows(check_decode_args(rows, pre, ext, tokens, fast, h, n, offset,
                                        static_cast<int64_t*>(out.data_ptr()), out.size(1)));
}

}  // namespace kvcanary

TVM_FFI_DLL_EXPORT_TYPED_FUNC(schema_version, kvcanary::schema_version);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(hash_splitmix64, kvcanary::hash_splitmix64);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(hash_chain_step, kvcanary::hash_chain_step);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(truth_segments, kvcanary::truth_segments);
