// Fingerprint of a slot's real K/V bytes (docs/ops-contract.md 1): per-source word sums, finalized once per slot.
#pragma once

#include "hash.cuh"

namespace kvcanary {

// One source row of a fingerprint table [H, n, NUM_FP_SOURCE_COLS] (validated by the Python side).
struct FpSource {
  const uint8_t* base;
  int64_t row_stride;
  int64_t page_size;
  int64_t bytes_per_token;
  int64_t read_bytes;
};

KVC_HD FpSource fp_source_at(const int64_t* table, int64_t n_sources, int64_t half, int64_t j) {
  const int64_t* r = table + (half * n_sources + j) * kNumFpSourceCols;
  return FpSource{reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(r[col(FpSourceCol::PTR)])),
                  r[col(FpSourceCol::ROW_STRIDE)], r[col(FpSourceCol::PAGE_SIZE)],
                  r[col(FpSourceCol::BYTES_PER_TOKEN)], r[col(FpSourceCol::READ_BYTES)]};
}

KVC_HD const uint64_t* fp_row(const FpSource& s, int64_t slot) {
  return reinterpret_cast<const uint64_t*>(s.base + (slot / s.page_size) * s.row_stride +
                                           (slot % s.page_size) * s.bytes_per_token);
}

// Words hashed of a source row: its READ_BYTES, at most PARTIAL_READ_BYTES of them in PARTIAL mode (a source with
// READ_BYTES 0 hashes nothing: the V half of HalfCoverage.FIRST's per-forward fingerprint).
KVC_HD int64_t fp_read_words(const FpSource& s, int32_t mode) {
  const bool cap = mode == static_cast<int32_t>(FingerprintMode::PARTIAL) && s.read_bytes > PARTIAL_READ_BYTES;
  const int64_t bytes = cap ? PARTIAL_READ_BYTES : s.read_bytes;
  return bytes / 8;
}

// Serial fingerprint (CPU, and the reference for the warp-cooperative CUDA version): mode != NONE.
KVC_HD uint64_t fingerprint_serial(const int64_t* table, int64_t n_sources, int64_t half, int64_t slot,
                                   int64_t position, int32_t mode, int64_t layer_stride) {
  uint64_t acc = 0;
  for (int64_t j = 0; j < n_sources; ++j) {
    if (!fp_source_selected(j, position, layer_stride)) continue;
    const FpSource s = fp_source_at(table, n_sources, half, j);
    const uint64_t* row = fp_row(s, slot);
    const int64_t words = fp_read_words(s, mode);
    for (int64_t i = 0; i < words; ++i) acc += fp_word_term(row[i], j, i);
  }
  return fp_finalize(acc, position);
}

}  // namespace kvcanary
