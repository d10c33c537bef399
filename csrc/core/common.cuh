// Shared by the CPU loops and the CUDA kernels: host/device qualifiers and the generated schema.
#pragma once

#include <cstdint>

#include "kvcanary/schema.h"

#if defined(__CUDACC__)
#define KVC_HD __host__ __device__ __forceinline__
#else
#define KVC_HD inline
#endif

namespace kvcanary {
using namespace kvcanary::schema;  // NOLINT: the schema is this project's vocabulary
}  // namespace kvcanary
