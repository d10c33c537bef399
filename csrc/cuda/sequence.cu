// CUDA module's make_sequence (core/sequence.h): the bound ops of one stage in one native call, launching their
// kernels on the caller's stream.
#include "core/sequence.h"

TVM_FFI_DLL_EXPORT_TYPED_FUNC(make_sequence, kvcanary::make_sequence);
