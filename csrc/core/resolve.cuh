// Resolving a table-space slot to a group slot (docs/ops-contract.md 0): input error, evicted, reserved or ok.
#pragma once

#include "common.cuh"

namespace kvcanary {

enum class SlotStatus : int32_t { kOk = 0, kInputError = 1, kEvicted = 2, kReserved = 3 };

// Group view: the FULL group has swa_map == nullptr; an SWA group translates through swa_map [map_len].
struct GroupView {
  int64_t num_slots;
  int64_t reserved_slots;
  const int64_t* swa_map;
  int64_t map_len;
};

struct Resolved {
  SlotStatus status;
  int64_t slot;  // the group slot when kOk/kReserved, else the offending value
};

KVC_HD Resolved resolve_slot(const GroupView& g, int64_t t) {
  if (g.swa_map == nullptr) {
    if (t < 0 || t >= g.num_slots) return Resolved{SlotStatus::kInputError, t};
  } else {
    if (t < 0 || t >= g.map_len) return Resolved{SlotStatus::kInputError, t};
    const int64_t m = g.swa_map[t];
    if (m < 0) return Resolved{SlotStatus::kEvicted, m};
    if (m >= g.num_slots) return Resolved{SlotStatus::kInputError, m};
    t = m;
  }
  if (t < g.reserved_slots) return Resolved{SlotStatus::kReserved, t};
  return Resolved{SlotStatus::kOk, t};
}

// Slot-table read that works for int32 and int64 tables. With page == 1 an entry is a slot (req_to_token); with
// page > 1 an entry is a block id (a paged block table): slot = table[r, c / page] * page + c % page, and a negative
// block id reads as itself (an input error, never a slot). `cols` is the logical row length (stride * page).
struct SlotTable {
  const void* data;
  bool is_i32;
  int64_t rows;
  int64_t cols;    // logical columns (positions) per row
  int64_t stride;  // stored entries per row
  int64_t page;    // slots per entry (>= 1)
  KVC_HD int64_t entry(int64_t r, int64_t e) const {
    const int64_t k = r * stride + e;
    return is_i32 ? static_cast<int64_t>(static_cast<const int32_t*>(data)[k]) : static_cast<const int64_t*>(data)[k];
  }
  KVC_HD int64_t at(int64_t r, int64_t c) const {
    if (page == 1) return entry(r, c);
    const int64_t b = entry(r, c / page);
    return b < 0 ? b : static_cast<int64_t>(static_cast<uint64_t>(b) * static_cast<uint64_t>(page) +
                                            static_cast<uint64_t>(c % page));
  }
};

}  // namespace kvcanary
