// Host-side argument validation shared by every tvm-ffi entry point: a clear ValueError/TypeError before any launch.
#pragma once

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>

#include <cstdint>
#include <initializer_list>

namespace kvcanary {

using tvm::ffi::TensorView;

inline const char* dtype_name(DLDataType t) {
  if (t.code == kDLInt && t.bits == 64 && t.lanes == 1) return "int64";
  if (t.code == kDLInt && t.bits == 32 && t.lanes == 1) return "int32";
  if (t.code == kDLUInt && t.bits == 8 && t.lanes == 1) return "uint8";
  return "other";
}
inline bool is_i64(const TensorView& t) { return t.dtype() == DLDataType{kDLInt, 64, 1}; }
inline bool is_i32(const TensorView& t) { return t.dtype() == DLDataType{kDLInt, 32, 1}; }

inline void check_i64(const TensorView& t, const char* name) {
  TVM_FFI_CHECK(is_i64(t), TypeError) << name << " must be int64, got " << dtype_name(t.dtype());
}
inline void check_index_dtype(const TensorView& t, const char* name) {
  TVM_FFI_CHECK(is_i64(t) || is_i32(t), TypeError) << name << " must be int32 or int64, got " << dtype_name(t.dtype());
}
inline void check_contiguous(const TensorView& t, const char* name) {
  TVM_FFI_CHECK(t.IsContiguous(), ValueError) << name << " must be contiguous";
}
inline void check_ndim(const TensorView& t, int ndim, const char* name) {
  TVM_FFI_CHECK(t.ndim() == ndim, ValueError) << name << " must have " << ndim << " dims, got " << t.ndim();
}
inline void check_dim(const TensorView& t, int axis, int64_t size, const char* name) {
  TVM_FFI_CHECK(t.size(axis) == size, ValueError)
      << name << ".shape[" << axis << "] must be " << size << ", got " << t.size(axis);
}
inline void check_same_device(const TensorView& a, const TensorView& b, const char* an, const char* bn) {
  TVM_FFI_CHECK(a.device().device_type == b.device().device_type && a.device().device_id == b.device().device_id,
                ValueError)
      << an << " and " << bn << " must be on the same device";
}
inline void check_device_type(const TensorView& t, DLDeviceType want, const char* name) {
  TVM_FFI_CHECK(t.device().device_type == want, ValueError)
      << name << " is on the wrong device type for this backend (" << t.device().device_type << ")";
}
// An int64 contiguous 1-D or N-D tensor, on `ref`'s device.
inline void check_i64_tensor(const TensorView& t, const TensorView& ref, int ndim, const char* name,
                             const char* ref_name) {
  check_i64(t, name);
  check_ndim(t, ndim, name);
  check_contiguous(t, name);
  check_same_device(t, ref, name, ref_name);
}

}  // namespace kvcanary
