// make_sequence (docs/ops-contract.md 9): one native call per stage of the per-forward device program. The ops'
// arguments were converted and checked when they were bound, once per install at the largest batch; a call passes the
// slot table and optionally the batch's shape (rows, new tokens), which cuts the arguments that follow it (ShapedArg)
// to that batch. The ops run in order on the stream of that call (tvm-ffi's environment stream, set by the caller).
#pragma once

#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "common.cuh"

namespace kvcanary {

struct SequenceOp {
  tvm::ffi::Function fn;
  std::vector<tvm::ffi::Any> args;                 // the bound arguments, the table's place left out
  int64_t table_at;                                // where the table goes among them; -1: the op takes no table
  std::vector<std::pair<size_t, ShapedArg>> shaped;  // the arguments cut to a call's batch shape
};

using CutArgs = std::vector<std::vector<tvm::ffi::Any>>;  // per op, its arguments at one shape

// Per call shape (rows, tokens): every op's arguments with the shaped ones cut (built on a shape's first call).
class ShapedArgs {
 public:
  static constexpr size_t kMaxShapes = 64;  // distinct shapes kept; past it the cache starts over

  std::shared_ptr<const CutArgs> at(const std::vector<SequenceOp>& ops, int64_t rows, int64_t tokens) {
    std::lock_guard<std::mutex> lock(mutex_);
    const std::pair<int64_t, int64_t> key{rows, tokens};
    auto found = cut_.find(key);
    if (found != cut_.end()) return found->second;
    if (cut_.size() >= kMaxShapes) cut_.clear();
    auto out = std::make_shared<CutArgs>();
    out->reserve(ops.size());
    for (const SequenceOp& op : ops) {
      std::vector<tvm::ffi::Any> args = op.args;
      for (const auto& [i, kind] : op.shaped) {
        if (kind == ShapedArg::NUM_TOKENS) {
          args[i] = tokens;
          continue;
        }
        const tvm::ffi::Tensor t = args[i].cast<tvm::ffi::Tensor>();
        std::vector<int64_t> shape(t.shape().begin(), t.shape().end());
        shape[0] = kind == ShapedArg::TOKENS ? tokens : kind == ShapedArg::PLAN_ROWS ? std::max<int64_t>(rows, 1) : rows;
        args[i] = t.as_strided(tvm::ffi::ShapeView(shape.data(), shape.size()), t.strides());
      }
      out->push_back(std::move(args));
    }
    cut_.emplace(key, out);
    return out;
  }

 private:
  std::mutex mutex_;  // a sequence may be called from several threads (each on its own stream)
  std::map<std::pair<int64_t, int64_t>, std::shared_ptr<const CutArgs>> cut_;
};

// The largest shape a sequence's bound arguments allow: (rows, tokens), each the smallest over its shaped arguments.
inline std::pair<int64_t, int64_t> sequence_capacity(const std::vector<SequenceOp>& ops) {
  int64_t rows = std::numeric_limits<int64_t>::max(), tokens = rows;
  for (const SequenceOp& op : ops) {
    for (const auto& [i, kind] : op.shaped) {
      if (kind == ShapedArg::NUM_TOKENS) {
        tokens = std::min(tokens, op.args[i].cast<int64_t>());
        continue;
      }
      const int64_t n = op.args[i].cast<tvm::ffi::Tensor>().shape()[0];
      if (kind == ShapedArg::TOKENS) {
        tokens = std::min(tokens, n);
      } else {
        rows = std::min(rows, n);  // PLAN_ROWS: max(rows, 1) <= n holds for every rows <= n once n >= 1 (checked)
      }
    }
  }
  return {rows, tokens};
}

inline std::vector<std::pair<size_t, ShapedArg>> sequence_shaped(const tvm::ffi::Array<int64_t>& pairs,
                                                                 const std::vector<tvm::ffi::Any>& args, size_t op) {
  TVM_FFI_CHECK(pairs.size() % 2 == 0, ValueError)
      << "make_sequence: op " << op << "'s shaped arguments are (index, kind) pairs, got " << pairs.size() << " values";
  std::vector<std::pair<size_t, ShapedArg>> out;
  for (size_t j = 0; j < pairs.size(); j += 2) {
    const int64_t i = pairs[j], kind = pairs[j + 1];
    TVM_FFI_CHECK(i >= 0 && i < static_cast<int64_t>(args.size()), ValueError)
        << "make_sequence: shaped argument " << i << " of op " << op << " outside [0, " << args.size() << ")";
    TVM_FFI_CHECK(kind >= static_cast<int64_t>(ShapedArg::BATCH_ROWS) &&
                      kind <= static_cast<int64_t>(ShapedArg::NUM_TOKENS),
                  ValueError)
        << "make_sequence: shaped argument " << i << " of op " << op << " has no ShapedArg kind " << kind;
    const tvm::ffi::Any& a = args[static_cast<size_t>(i)];
    if (static_cast<ShapedArg>(kind) == ShapedArg::NUM_TOKENS) {
      TVM_FFI_CHECK(a.as<int64_t>().has_value() && a.cast<int64_t>() >= 0, TypeError)
          << "make_sequence: argument " << i << " of op " << op << " (NUM_TOKENS) must be an int >= 0";
    } else {
      const auto t = a.as<tvm::ffi::Tensor>();
      TVM_FFI_CHECK(t.has_value() && t->ndim() >= 1, TypeError)
          << "make_sequence: argument " << i << " of op " << op << " (a shaped tensor) must be a tensor of rank >= 1";
      TVM_FFI_CHECK(static_cast<ShapedArg>(kind) != ShapedArg::PLAN_ROWS || t->shape()[0] >= 1, ValueError)
          << "make_sequence: argument " << i << " of op " << op << " (PLAN_ROWS) has no row";
    }
    out.emplace_back(static_cast<size_t>(i), static_cast<ShapedArg>(kind));
  }
  return out;
}

// fns[i] is called with args[i], the slot table inserted before args[i][table_at[i]] (table_at[i] == len: last;
// -1: not passed), the arguments named by shaped[i] (flat (index, ShapedArg) pairs) cut to the call's shape.
inline tvm::ffi::Function make_sequence(const tvm::ffi::Array<tvm::ffi::Function>& fns,
                                        const tvm::ffi::Array<tvm::ffi::Array<tvm::ffi::Any>>& args,
                                        const tvm::ffi::Array<int64_t>& table_at,
                                        const tvm::ffi::Array<tvm::ffi::Array<int64_t>>& shaped) {
  TVM_FFI_CHECK(fns.size() == args.size() && fns.size() == table_at.size() && fns.size() == shaped.size(), ValueError)
      << "make_sequence: " << fns.size() << " functions, " << args.size() << " argument lists, " << table_at.size()
      << " table positions, " << shaped.size() << " shaped lists";
  std::vector<SequenceOp> ops;
  for (size_t i = 0; i < fns.size(); ++i) {
    const tvm::ffi::Array<tvm::ffi::Any> a = args[i];
    const int64_t at = table_at[i];
    TVM_FFI_CHECK(at >= -1 && at <= static_cast<int64_t>(a.size()), ValueError)
        << "make_sequence: table position " << at << " of op " << i << " outside [-1, " << a.size() << "]";
    std::vector<tvm::ffi::Any> bound(a.begin(), a.end());
    auto cut = sequence_shaped(shaped[i], bound, i);
    ops.push_back(SequenceOp{fns[i], std::move(bound), at, std::move(cut)});
  }
  const auto [max_rows, max_tokens] = sequence_capacity(ops);
  return tvm::ffi::Function::FromPacked([ops = std::move(ops), cache = std::make_shared<ShapedArgs>(), max_rows,
                                         max_tokens](tvm::ffi::PackedArgs call, tvm::ffi::Any* rv) {
    TVM_FFI_CHECK(call.size() == 1 || call.size() == 3, TypeError)
        << "a sequence takes the slot table, optionally with the batch's rows and tokens; got " << call.size()
        << " arguments";
    std::shared_ptr<const CutArgs> cut;
    if (call.size() == 3) {
      const int64_t rows = call[1].cast<int64_t>(), tokens = call[2].cast<int64_t>();
      TVM_FFI_CHECK(rows >= 0 && rows <= max_rows && tokens >= 0 && tokens <= max_tokens, ValueError)
          << "a sequence bound for at most " << max_rows << " rows and " << max_tokens << " tokens called with "
          << rows << " rows and " << tokens << " tokens";
      cut = cache->at(ops, rows, tokens);
    }
    std::vector<tvm::ffi::AnyView> buf;
    for (size_t i = 0; i < ops.size(); ++i) {
      const SequenceOp& op = ops[i];
      const std::vector<tvm::ffi::Any>& a = cut == nullptr ? op.args : (*cut)[i];
      const int64_t at = op.table_at < 0 ? static_cast<int64_t>(a.size()) : op.table_at;
      buf.assign(a.begin(), a.begin() + at);
      if (op.table_at >= 0) buf.push_back(call[0]);
      buf.insert(buf.end(), a.begin() + at, a.end());
      tvm::ffi::Any ignored;
      op.fn.CallPacked(buf.data(), static_cast<int32_t>(buf.size()), &ignored);
    }
    *rv = nullptr;
  });
}

}  // namespace kvcanary
