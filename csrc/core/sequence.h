// make_sequence (docs/ops-contract.md 9): one native call per stage of the per-forward device program. The ops'
// arguments were converted and checked when they were bound; a call of the sequence passes only the slot table,
// and the ops run in order on the stream of that call (tvm-ffi's environment stream, set by the caller).
#pragma once

#include <tvm/ffi/container/array.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace kvcanary {

struct SequenceOp {
  tvm::ffi::Function fn;
  std::vector<tvm::ffi::Any> args;  // the bound arguments, the table's place left out
  int64_t table_at;                 // where the table goes among them; -1: the op takes no table
};

// fns[i] is called with args[i], the slot table inserted before args[i][table_at[i]] (table_at[i] == len: last;
// -1: not passed).
inline tvm::ffi::Function make_sequence(const tvm::ffi::Array<tvm::ffi::Function>& fns,
                                        const tvm::ffi::Array<tvm::ffi::Array<tvm::ffi::Any>>& args,
                                        const tvm::ffi::Array<int64_t>& table_at) {
  TVM_FFI_CHECK(fns.size() == args.size() && fns.size() == table_at.size(), ValueError)
      << "make_sequence: " << fns.size() << " functions, " << args.size() << " argument lists, " << table_at.size()
      << " table positions";
  std::vector<SequenceOp> ops;
  for (size_t i = 0; i < fns.size(); ++i) {
    const tvm::ffi::Array<tvm::ffi::Any> a = args[i];
    const int64_t at = table_at[i];
    TVM_FFI_CHECK(at >= -1 && at <= static_cast<int64_t>(a.size()), ValueError)
        << "make_sequence: table position " << at << " of op " << i << " outside [-1, " << a.size() << "]";
    ops.push_back(SequenceOp{fns[i], std::vector<tvm::ffi::Any>(a.begin(), a.end()), at});
  }
  return tvm::ffi::Function::FromPacked(
      [ops = std::move(ops)](tvm::ffi::PackedArgs call, tvm::ffi::Any* rv) {
        TVM_FFI_CHECK(call.size() == 1, TypeError) << "a sequence takes the slot table only, got " << call.size()
                                                  << " arguments";
        std::vector<tvm::ffi::AnyView> buf;
        for (const SequenceOp& op : ops) {
          const int64_t at = op.table_at < 0 ? static_cast<int64_t>(op.args.size()) : op.table_at;
          buf.assign(op.args.begin(), op.args.begin() + at);
          if (op.table_at >= 0) buf.push_back(call[0]);
          buf.insert(buf.end(), op.args.begin() + at, op.args.end());
          tvm::ffi::Any ignored;
          op.fn.CallPacked(buf.data(), static_cast<int32_t>(buf.size()), &ignored);
        }
        *rv = nullptr;
      });
}

}  // namespace kvcanary
