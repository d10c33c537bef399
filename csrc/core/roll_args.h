// Host checks of the rolling-sweep slice arguments (derive_roll, plan_roll) and the raw view both backends plan from.
#pragma once

#include "plan.cuh"
#include "tensor_checks.h"

namespace kvcanary {

// One sweep chain as plan_sweep consumes it (docs/ops-contract.md 3).
struct SweepChain {
  int64_t start, len, first_position, prev_slot, expect_end;
};

inline void check_slot_ids(int64_t num_slot_ids, const TensorView& inv) {
  TVM_FFI_CHECK(num_slot_ids >= 1, ValueError) << "num_slot_ids must be >= 1, got " << num_slot_ids;
  TVM_FFI_CHECK(inv.size(0) >= num_slot_ids, ValueError)
      << "inv has " << inv.size(0) << " entries, needs num_slot_ids = " << num_slot_ids;
}

// derive_roll: slots int64 [N], lens and ends int64 [n], inv int64 [>= num_slot_ids], contiguous, on one `device`.
inline void check_derive_roll_args(DLDeviceType device, const TensorView& slots, const TensorView& lens,
                                   const TensorView& inv, const TensorView& ends, int64_t num_slot_ids) {
  check_i64_tensor(slots, slots, 1, "slots", "slots");
  check_device_type(slots, device, "slots");
  check_chain_arrays(slots, "slots", lens, "lens", {{&ends, "ends"}});
  check_i64_tensor(inv, slots, 1, "inv", "slots");
  check_slot_ids(num_slot_ids, inv);
}

// Validates every export argument of plan_roll (raising ValueError/TypeError naming it) before any launch.
inline RollSource roll_source(const TensorView& slots, const TensorView& starts, const TensorView& lens,
                              const TensorView& ends, const TensorView& first_positions, const TensorView& prev_slots,
                              const TensorView& unlocked, int64_t has_unlocked, const TensorView& inv,
                              int64_t num_slot_ids, int64_t cursor) {
  const int64_t n = check_chain_arrays(slots, "slots", starts, "starts",
                                       {{&lens, "lens"}, {&ends, "ends"}, {&first_positions, "first_positions"},
                                        {&prev_slots, "prev_slots"}});
  check_optional(unlocked, has_unlocked, slots, n, "unlocked", "slots");
  check_i64_tensor(inv, slots, 1, "inv", "slots");
  check_slot_ids(num_slot_ids, inv);
  TVM_FFI_CHECK(cursor >= 0 && cursor < num_slot_ids, ValueError)
      << "cursor must be in [0, " << num_slot_ids << "), got " << cursor;
  return RollSource{static_cast<const int64_t*>(inv.data_ptr()),
                    num_slot_ids,
                    static_cast<const int64_t*>(slots.data_ptr()),
                    slots.size(0),
                    static_cast<const int64_t*>(starts.data_ptr()),
                    static_cast<const int64_t*>(lens.data_ptr()),
                    static_cast<const int64_t*>(ends.data_ptr()),
                    static_cast<const int64_t*>(first_positions.data_ptr()),
                    static_cast<const int64_t*>(prev_slots.data_ptr()),
                    has_unlocked ? static_cast<const int64_t*>(unlocked.data_ptr()) : nullptr,
                    n};
}

}  // namespace kvcanary
