// Batch staging (docs/ops-contract.md 8b): one forward's batch into the static buffers the bound ops read, padded
// to the bound shape; element i of the row part and element k of the token part, shared by the CPU loop and the
// CUDA kernel.
#pragma once

#include "common.cuh"

namespace kvcanary {

// The six batch arrays (int32 or int64 each), the host staging rows and the static destinations.
struct StageArgs {
  const void* src[6];  // req_pool_indices, prefix_lens, extend_lens [bs]; input_ids, positions, out_cache_loc [nt]
  bool src_i32[6];
  const int64_t* staging;  // [U, staging_cols]: rows [0, U) x [0, bs) are copied (CUDA: its device-mapped address)
  int64_t staging_cols;
  int64_t* rows;    // [3, row_cap]: req_pool_indices, prefix_lens, extend_lens
  int64_t* truth;   // [U, row_cap]
  int64_t* tokens;  // [3, token_cap]: input_ids, positions, out_cache_loc
  int64_t row_cap, token_cap, U, bs, nt, pad_rows, pad_tokens, padding_row;
};

KVC_HD int64_t stage_src(const StageArgs& a, int which, int64_t i) {
  return a.src_i32[which] ? static_cast<const int32_t*>(a.src[which])[i] : static_cast<const int64_t*>(a.src[which])[i];
}

// Row i < pad_rows: the batch's row, or (i >= bs) a padding row that plans nothing.
KVC_HD void stage_row(const StageArgs& a, int64_t i) {
  if (i < a.bs) {
    for (int r = 0; r < 3; ++r) a.rows[r * a.row_cap + i] = stage_src(a, r, i);
    for (int64_t u = 0; u < a.U; ++u) a.truth[u * a.row_cap + i] = a.staging[u * a.staging_cols + i];
  } else {
    a.rows[i] = a.padding_row;
    a.rows[a.row_cap + i] = 0;
    a.rows[2 * a.row_cap + i] = 0;
  }
}

// Token k < pad_tokens: the batch's token, or (k >= nt) a token that is never written (out_cache_loc -1).
KVC_HD void stage_token(const StageArgs& a, int64_t k) {
  if (k < a.nt) {
    for (int r = 0; r < 3; ++r) a.tokens[r * a.token_cap + k] = stage_src(a, 3 + r, k);
  } else {
    a.tokens[2 * a.token_cap + k] = -1;
  }
}

}  // namespace kvcanary
