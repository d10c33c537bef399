// The violation sink shared by verify and write: ring append (exact count, first-cap rows kept) and counters.
#pragma once

#include "common.cuh"

namespace kvcanary {

KVC_HD int64_t atomic_add_i64(int64_t* p, int64_t v) {
#if defined(__CUDA_ARCH__)
  return static_cast<int64_t>(atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v)));
#else
  return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
#endif
}

// Raw views of the sink tensors (validated by the host entry): ring_rows [cap, NUM_VIOLATION_COLS],
// ring_count [1], counters [NUM_LAUNCH_TAGS, NUM_COUNTER_COLS], step [1].
struct SinkView {
  int64_t* rows;
  int64_t* count;
  int64_t cap;
  int64_t* counters;
  const int64_t* step;
};

KVC_HD void count(const SinkView& sink, int64_t tag, CounterCol which, int64_t v) {
  if (v != 0) atomic_add_i64(&sink.counters[tag * kNumCounterCols + col(which)], v);
}

// A violation row under construction; fields not set stay as initialised here.
struct Violation {
  int64_t v[kNumViolationCols];
  KVC_HD Violation() {
    for (int i = 0; i < kNumViolationCols; ++i) v[i] = 0;
    v[col(ViolationCol::EXPECTED_TOKEN)] = SKIP_TOKEN;
    v[col(ViolationCol::EXPECTED_SLOT)] = NO_SLOT;
  }
  KVC_HD int64_t& operator[](ViolationCol c) { return v[col(c)]; }
};

// Append one row: the count is exact, rows beyond the capacity are dropped (and counted by the drain).
KVC_HD void emit(const SinkView& sink, Violation& row) {
  const int64_t tag = row[ViolationCol::TAG];
  row[ViolationCol::STEP] = sink.step[0];
  count(sink, tag, CounterCol::VIOLATIONS, 1);
  const int64_t k = atomic_add_i64(sink.count, 1);
  if (k < sink.cap) {
    int64_t* dst = sink.rows + k * kNumViolationCols;
    for (int i = 0; i < kNumViolationCols; ++i) dst[i] = row.v[i];
  }
}

}  // namespace kvcanary
