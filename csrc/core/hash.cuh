// Chain and fingerprint hashes of DESIGN 4, shared bit for bit by CPU and CUDA (u64, mod 2^64).
#pragma once

#include "common.cuh"

namespace kvcanary {

// The splitmix64 finalizer: a bijection on u64.
KVC_HD uint64_t splitmix64(uint64_t x) {
  x ^= x >> 30;
  x *= SPLITMIX_MUL1;
  x ^= x >> 27;
  x *= SPLITMIX_MUL2;
  x ^= x >> 31;
  return x;
}

// True when a token or position may enter the chain (g is injective only on [0, 2^31)).
KVC_HD bool chain_value_ok(int64_t v) { return v >= 0 && v < TOKEN_LIMIT; }

// g(t, p): the chain contribution of one (token, position); callers check chain_value_ok first.
KVC_HD uint64_t chain_g(int64_t token, int64_t position) {
  return splitmix64(((static_cast<uint64_t>(position) << 32) | static_cast<uint64_t>(token)) ^ CHAIN_SEED);
}

// h_0: the chain value before the first token of every history.
KVC_HD uint64_t chain_h0() { return splitmix64(CHAIN_ANCHOR); }

// h_{k+1} from h_k and the k-th (token, position).
KVC_HD uint64_t chain_step(uint64_t h, int64_t token, int64_t position) {
  return h * CHAIN_BASE + chain_g(token, position);
}

// The affine map x -> x * mul + add of a run of tokens; composing is associative (a parallel scan).
struct ChainMap {
  uint64_t mul;
  uint64_t add;
};
KVC_HD ChainMap chain_identity() { return ChainMap{1ULL, 0ULL}; }
KVC_HD ChainMap chain_token_map(int64_t token, int64_t position) {
  return ChainMap{CHAIN_BASE, chain_g(token, position)};
}
// "first then second".
KVC_HD ChainMap chain_compose(ChainMap first, ChainMap second) {
  return ChainMap{first.mul * second.mul, first.add * second.mul + second.add};
}
KVC_HD uint64_t chain_apply(ChainMap m, uint64_t h) { return h * m.mul + m.add; }

// Fingerprint word term: word i of source j, keyed so that equal words in other places differ.
KVC_HD uint64_t fp_word_term(uint64_t word, int64_t source, int64_t word_index) {
  const uint64_t key = FP_SEED + ((static_cast<uint64_t>(source) << 32) + static_cast<uint64_t>(word_index)) * FP_GAMMA;
  return splitmix64(word ^ key);
}

// Final fingerprint of a slot from the wrapped sum of its word terms and its position (never its slot).
KVC_HD uint64_t fp_finalize(uint64_t acc, int64_t position) {
  return splitmix64(acc ^ splitmix64(static_cast<uint64_t>(position) ^ FP_POS_SEED));
}

// Source j is hashed for a record at position p iff (j + p) % stride == 0 (stride >= 1).
KVC_HD bool fp_source_selected(int64_t source, int64_t position, int64_t stride) {
  return ((source + position) % stride) == 0;
}

}  // namespace kvcanary
