// Host token truth of a steady decode (docs/ops-contract.md 8a): one call replaces the bulk hasher's numpy steps when
// every live request continues its row's chain with one new token, and fills the staging rows directly.
#include <tvm/ffi/function.h>

#include "core/hash.cuh"
#include "core/tensor_checks.h"

namespace kvcanary {
namespace {

constexpr int64_t kNotSteady = -1;
constexpr int64_t kBadValue = -2;
// Staging rows (docs/ops-contract.md 8a): expect_prefix, expect_new, flag mask, stripe end, reuse end.
constexpr int64_t kStagingRows = 5;
constexpr int64_t kKeepAll = -1;
constexpr int64_t kNoNew = ~static_cast<int64_t>(PlanFlag::EXPECT_NEW);

bool is_bool(const TensorView& t) { return t.dtype() == DLDataType{kDLBool, 8, 1}; }

void check_bool_mask(const TensorView& t, int64_t n, const char* name) {
  TVM_FFI_CHECK(is_bool(t), TypeError) << name << " must be bool";
  check_ndim(t, 1, name);
  check_contiguous(t, name);
  check_device_type(t, kDLCPU, name);
  check_dim(t, 0, n, name);
}

void check_host_i64(const TensorView& t, const char* name) {
  check_i64(t, name);
  check_ndim(t, 1, name);
  check_contiguous(t, name);
  check_device_type(t, kDLCPU, name);
}

}  // namespace

// rows/pre/ext int64 [bs], tokens int64 [>= sum ext] (negative = unknown), live/owned bool [bs], h/n int64 [R] (the
// rows' chain values as u64 bit-casts and true tokens consumed), out int64 [5, cap >= bs]. Returns kNotSteady (-1,
// nothing written) unless every live row i is owned, has ext 1 and n[rows[i]] == pre[i] + offset; kBadValue (-2,
// nothing written) when a known token or a position is outside [0, TOKEN_LIMIT); else the count of live rows whose new
// token is unknown (their mask drops EXPECT_NEW), with out[:, :bs] filled and h/n advanced past the known tokens.
int64_t truth_decode(TensorView rows, TensorView pre, TensorView ext, TensorView tokens, TensorView live,
                     TensorView owned, TensorView h, TensorView n, int64_t offset, TensorView out) {
  check_host_i64(rows, "rows");
  const int64_t bs = rows.size(0);
  check_host_i64(pre, "pre");
  check_dim(pre, 0, bs, "pre");
  check_host_i64(ext, "ext");
  check_dim(ext, 0, bs, "ext");
  check_host_i64(tokens, "tokens");
  check_bool_mask(live, bs, "live");
  check_bool_mask(owned, bs, "owned");
  check_host_i64(h, "h");
  check_host_i64(n, "n");
  check_dim(n, 0, h.size(0), "n");
  check_i64(out, "out");
  check_ndim(out, 2, "out");
  check_contiguous(out, "out");
  check_device_type(out, kDLCPU, "out");
  check_dim(out, 0, kStagingRows, "out");
  TVM_FFI_CHECK(out.size(1) >= bs, ValueError) << "out has " << out.size(1) << " columns for " << bs << " rows";
  TVM_FFI_CHECK(offset >= 0, ValueError) << "offset must be >= 0, got " << offset;

  const auto* rv = static_cast<const int64_t*>(rows.data_ptr());
  const auto* pv = static_cast<const int64_t*>(pre.data_ptr());
  const auto* ev = static_cast<const int64_t*>(ext.data_ptr());
  const auto* tv = static_cast<const int64_t*>(tokens.data_ptr());
  const auto* lv = static_cast<const bool*>(live.data_ptr());
  const auto* ov = static_cast<const bool*>(owned.data_ptr());
  auto* hv = static_cast<uint64_t*>(h.data_ptr());
  auto* nv = static_cast<int64_t*>(n.data_ptr());
  const int64_t num_rows = h.size(0), num_tokens = tokens.size(0), cap = out.size(1);
  auto* o = static_cast<int64_t*>(out.data_ptr());

  // Pass 1: steady, in range, every index inside its array (nothing is written before all rows pass).
  int64_t at = 0;
  for (int64_t i = 0; i < bs; ++i) {
    if (ev[i] < 0) return kNotSteady;
    const int64_t begin = at;
    at += ev[i];
    if (!lv[i]) continue;
    const int64_t row = rv[i];
    if (!ov[i] || ev[i] != 1 || row < 0 || row >= num_rows || begin >= num_tokens || nv[row] != pv[i] + offset) {
      return kNotSteady;
    }
    if (!chain_value_ok(pv[i]) || (tv[begin] >= 0 && !chain_value_ok(tv[begin]))) return kBadValue;
  }
  // Pass 2: the staging rows, from the state before this forward (a row named twice reads its old value, as the
  // vectorized path's gathers do).
  int64_t unknown = 0;
  at = 0;
  for (int64_t i = 0; i < bs; ++i) {
    const int64_t begin = at;
    at += ev[i];
    int64_t expect_prefix = 0, expect_new = 0, mask = kKeepAll;
    if (lv[i]) {
      const uint64_t h0 = hv[rv[i]];
      const int64_t tok = tv[begin];
      expect_prefix = pv[i] > 0 ? static_cast<int64_t>(h0) : 0;
      if (tok >= 0) {
        expect_new = static_cast<int64_t>(chain_step(h0, tok, pv[i]));
      } else {
        mask = kNoNew;
        ++unknown;
      }
    }
    o[i] = expect_prefix;
    o[cap + i] = expect_new;
    o[2 * cap + i] = mask;
    o[3 * cap + i] = 0;
    o[4 * cap + i] = 0;
  }
  // Pass 3: advance the rows past their known new token (the last of a repeated row wins, as in numpy).
  at = 0;
  for (int64_t i = 0; i < bs; ++i) {
    const int64_t begin = at;
    at += ev[i];
    if (lv[i] && tv[begin] >= 0) {
      hv[rv[i]] = static_cast<uint64_t>(o[cap + i]);
      nv[rv[i]] = pv[i] + offset + 1;
    }
  }
  return unknown;
}

}  // namespace kvcanary

TVM_FFI_DLL_EXPORT_TYPED_FUNC(truth_decode, kvcanary::truth_decode);
