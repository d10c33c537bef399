// Host token truth of a steady decode (docs/ops-contract.md 8a) for both modules' begin_decode (8c): the checks that
// build its arguments, and the decode over raw host arrays.
#pragma once

#include "core/hash.cuh"
#include "core/tensor_checks.h"

namespace kvcanary {

constexpr int64_t kNotSteady = -1;
constexpr int64_t kBadValue = -2;
// Staging rows (docs/ops-contract.md 8a): expect_prefix, expect_new, flag mask, stripe end, reuse end.
constexpr int64_t kStagingRows = 5;

struct DecodeArgs {
  const int64_t* rows;
  const int64_t* pre;
  const int64_t* ext;
  const int64_t* tokens;
  const bool* live;
  uint64_t* h;
  int64_t* n;
  int64_t* out;  // [kStagingRows, cap]
  int64_t bs, num_rows, num_tokens, offset, cap;
};

inline void check_bool_mask(const TensorView& t, int64_t n, const char* name) {
  TVM_FFI_CHECK(t.dtype() == (DLDataType{kDLBool, 8, 1}), TypeError) << name << " must be bool";
  check_ndim(t, 1, name);
  check_contiguous(t, name);
  check_device_type(t, kDLCPU, name);
  check_dim(t, 0, n, name);
}

inline void check_host_i64(const TensorView& t, const char* name) {
  check_i64(t, name);
  check_ndim(t, 1, name);
  check_contiguous(t, name);
  check_device_type(t, kDLCPU, name);
}

// rows/pre/ext int64 [bs], tokens int64 [>= sum ext], live bool [bs], h/n int64 [R]; the staging rows `out` (int64
// [kStagingRows, >= bs], host memory) are checked by the caller and passed as a pointer and column count.
inline DecodeArgs check_decode_args(const TensorView& rows, const TensorView& pre, const TensorView& ext,
                                    const TensorView& tokens, const TensorView& live, const TensorView& h,
                                    const TensorView& n, int64_t offset, int64_t* out, int64_t cap) {
  check_host_i64(rows, "rows");
  const int64_t bs = rows.size(0);
  check_host_i64(pre, "pre");
  check_dim(pre, 0, bs, "pre");
  check_host_i64(ext, "ext");
  check_dim(ext, 0, bs, "ext");
  check_host_i64(tokens, "tokens");
  check_bool_mask(live, bs, "live");
  check_host_i64(h, "h");
  check_host_i64(n, "n");
  check_dim(n, 0, h.size(0), "n");
  TVM_FFI_CHECK(cap >= bs, ValueError) << "out has " << cap << " columns for " << bs << " rows";
  TVM_FFI_CHECK(offset >= 0, ValueError) << "offset must be >= 0, got " << offset;
  return DecodeArgs{static_cast<const int64_t*>(rows.data_ptr()), static_cast<const int64_t*>(pre.data_ptr()),
                    static_cast<const int64_t*>(ext.data_ptr()),  static_cast<const int64_t*>(tokens.data_ptr()),
                    static_cast<const bool*>(live.data_ptr()),
                    static_cast<uint64_t*>(h.data_ptr()),         static_cast<int64_t*>(n.data_ptr()),
                    out, bs, h.size(0), tokens.size(0), offset, cap};
}

// Row i's chain value after its ext[i] new tokens at tokens[begin...], from `h`; true (`h` advanced) when there is at
// least one and every one is known, false (`h` unspecified) otherwise.
inline bool fold_new(const DecodeArgs& a, int64_t i, int64_t begin, uint64_t& h) {
  const int64_t e = a.ext[i];
  for (int64_t j = 0; j < e; ++j) {
    const int64_t tok = a.tokens[begin + j];
    if (tok < 0) return false;
    h = chain_step(h, tok, a.pre[i] + j);
  }
  return e > 0;
}

// kNotSteady (nothing written) unless every ext[i] >= 0 and every live row i continues its chain: a row inside [0, R),
// its tokens inside `tokens`, n[rows[i]] == pre[i] + offset (the row's state is its request's: the runtime resets a
// row that changes hands); kBadValue (nothing written) when a live row's new position or known token is outside
// [0, TOKEN_LIMIT); else the count of live rows whose new tokens are not all known (or none), with out[:, :bs] filled
// (`reuse`: the reuse ends, null: 0) and h/n advanced past the rows whose new tokens are all known.
inline int64_t decode_rows(const DecodeArgs& a, const int64_t* reuse) {
  constexpr int64_t kKeepAll = -1;
  constexpr int64_t kNoNew = ~static_cast<int64_t>(PlanFlag::EXPECT_NEW);
  // Pass 1: steady, in range, every index inside its array (nothing is written before all rows pass).
  int64_t at = 0;
  for (int64_t i = 0; i < a.bs; ++i) {
    const int64_t begin = at, e = a.ext[i];  // begin >= 0: every earlier ext was
    if (e < 0 || __builtin_add_overflow(at, e, &at)) return kNotSteady;
    if (!a.live[i]) continue;
    const int64_t row = a.rows[i];
    if (row < 0 || row >= a.num_rows || e > a.num_tokens - begin || a.n[row] != a.pre[i] + a.offset) {
      return kNotSteady;
    }
    for (int64_t j = 0; j < e; ++j) {
      const int64_t tok = a.tokens[begin + j];
      if (!chain_value_ok(a.pre[i] + j) || (tok >= 0 && !chain_value_ok(tok))) return kBadValue;
    }
  }
  // Pass 2: the staging rows, from the state before this forward (a row named twice reads its old value, as the
  // vectorized path's gathers do).
  int64_t unknown = 0;
  at = 0;
  int64_t* o = a.out;
  for (int64_t i = 0; i < a.bs; ++i) {
    const int64_t begin = at;
    at += a.ext[i];
    int64_t expect_prefix = 0, expect_new = 0, mask = kKeepAll;
    if (a.live[i]) {
      uint64_t h = a.h[a.rows[i]];
      expect_prefix = a.pre[i] > 0 ? static_cast<int64_t>(h) : 0;
      if (fold_new(a, i, begin, h)) {
        expect_new = static_cast<int64_t>(h);
      } else {
        mask = kNoNew;
        ++unknown;
      }
    }
    o[i] = expect_prefix;
    o[a.cap + i] = expect_new;
    o[2 * a.cap + i] = mask;
    o[3 * a.cap + i] = 0;
    o[4 * a.cap + i] = reuse != nullptr ? reuse[i] : 0;
  }
  // Pass 3: advance the rows past their known new tokens (the last of a repeated row wins, as in numpy).
  for (int64_t i = 0; i < a.bs; ++i) {
    if (a.live[i] && o[2 * a.cap + i] == kKeepAll) {
      a.h[a.rows[i]] = static_cast<uint64_t>(o[a.cap + i]);
      a.n[a.rows[i]] = a.pre[i] + a.ext[i] + a.offset;
    }
  }
  return unknown;
}

// truth_segments (docs/ops-contract.md 8d): the continuing rows of any forward, each folding its ext[i] new tokens.
// `a.live` marks those rows; `out` is int64 [4, a.cap]: expect_prefix, expect_new, prefix_known, new_known (0/1).
// kNotSteady (nothing written) when a marked row lies outside [0, R) or its tokens outside `tokens`; kBadValue
// (nothing written) when a marked row's known token or its position is outside [0, TOKEN_LIMIT); else 0.
inline int64_t segment_rows(const DecodeArgs& a) {
  int64_t at = 0;
  for (int64_t i = 0; i < a.bs; ++i) {  // pass 1: every check before any write
    const int64_t begin = at, e = a.ext[i];
    if (__builtin_add_overflow(at, e, &at)) return kNotSteady;  // no prefix sum of ext can index `tokens`
    if (!a.live[i]) continue;
    if (a.rows[i] < 0 || a.rows[i] >= a.num_rows || (e > 0 && (begin < 0 || e > a.num_tokens - begin))) {
      return kNotSteady;
    }
    for (int64_t j = 0; j < e; ++j) {
      const int64_t tok = a.tokens[begin + j];
      if (tok >= 0 && !(chain_value_ok(tok) && chain_value_ok(a.pre[i] + j))) return kBadValue;
    }
  }
  int64_t* o = a.out;
  at = 0;
  for (int64_t i = 0; i < a.bs; ++i) {  // pass 2: outputs from the state before the call
    const int64_t begin = at, e = a.ext[i];
    at += e;
    int64_t expect_prefix = 0, expect_new = 0, prefix_known = 0, new_known = 0;
    if (a.live[i]) {
      uint64_t h = a.h[a.rows[i]];
      prefix_known = a.pre[i] > 0 ? 1 : 0;
      expect_prefix = prefix_known ? static_cast<int64_t>(h) : 0;
      const bool known = fold_new(a, i, begin, h);
      new_known = known ? 1 : 0;
      expect_new = known ? static_cast<int64_t>(h) : 0;
    }
    o[i] = expect_prefix;
    o[a.cap + i] = expect_new;
    o[2 * a.cap + i] = prefix_known;
    o[3 * a.cap + i] = new_known;
  }
  for (int64_t i = 0; i < a.bs; ++i) {  // pass 3: rows past their known tokens (a row named twice: the last wins)
    if (a.live[i] && o[3 * a.cap + i]) {
      a.h[a.rows[i]] = static_cast<uint64_t>(o[a.cap + i]);
      a.n[a.rows[i]] = a.pre[i] + a.ext[i] + a.offset;
    }
  }
  return 0;
}

// begin_decode (8c): the batch facts' checks and the steady batch into the staging rows (`reuse`: int64 [bs] reuse ends,
// or [0]: none), then each live row's forward `step` and prefix into seen/prefix (int64 [R]); the caller stages after a
// result >= 0. `ext` must not claim more new tokens than the batch has (an input error, as BatchView.validate says).
inline int64_t begin_decode_host(const StageArgs& s, int64_t* staging, const TensorView& rows, const TensorView& pre,
                                 const TensorView& ext, const TensorView& tokens, const TensorView& live,
                                 const TensorView& h, const TensorView& n, int64_t offset, const TensorView& seen,
                                 const TensorView& prefix, int64_t step, const TensorView& reuse) {
  TVM_FFI_CHECK(s.U == kStagingRows, ValueError) << "staging must have " << kStagingRows << " rows, got " << s.U;
  const DecodeArgs d = check_decode_args(rows, pre, ext, tokens, live, h, n, offset, staging, s.staging_cols);
  check_host_i64(seen, "seen");
  check_dim(seen, 0, d.num_rows, "seen");
  check_host_i64(prefix, "prefix");
  check_dim(prefix, 0, d.num_rows, "prefix");
  check_host_i64(reuse, "reuse");
  TVM_FFI_CHECK(reuse.size(0) == 0 || reuse.size(0) == d.bs, ValueError)
      << "reuse must have 0 or " << d.bs << " entries, got " << reuse.size(0);
  TVM_FFI_CHECK(d.bs == s.bs, ValueError) << "rows has " << d.bs << " entries, the batch has " << s.bs << " rows";
  check_dim(tokens, 0, s.nt, "tokens");
  for (int64_t i = 0, claimed = 0; i < d.bs; ++i) {  // claimed <= nt throughout: the sum cannot wrap
    const int64_t e = d.ext[i] > 0 ? d.ext[i] : 0;
    TVM_FFI_CHECK(e <= s.nt - claimed, ValueError) << "ext sums to more than the " << s.nt << " new tokens";
    claimed += e;
  }
  const int64_t got = decode_rows(d, reuse.size(0) > 0 ? static_cast<const int64_t*>(reuse.data_ptr()) : nullptr);
  if (got < 0) return got;
  auto* sv = static_cast<int64_t*>(seen.data_ptr());
  auto* pv = static_cast<int64_t*>(prefix.data_ptr());
  for (int64_t i = 0; i < d.bs; ++i) {
    if (d.live[i]) {  // a steady batch's live rows all lie in [0, R)
      sv[d.rows[i]] = step;
      pv[d.rows[i]] = d.pre[i];
    }
  }
  return got;
}

}  // namespace kvcanary
