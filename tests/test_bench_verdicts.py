"""The transformers benchmark's verdicts: the step pairs' median interval (hand-computed ranks, a brute-force
binomial; noise must never produce a met), the profiled timeline's steps (hand-built events, the busy union against
a brute-force count), and runs pooled into one verdict."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from bench.bench_transformers import MARK, _combined, _median_ci, _quartiles, _union_us, _verdict, timeline_steps
from bench.pool_tf_runs import PoolError, pool


@pytest.mark.parametrize(("n", "ranks"), [
    (5, None),     # P(all 5 on one side) = 1/32 > 2.5 %: no interval
    (6, (1, 6)),   # 1/64 <= 2.5 % < 7/64
    (8, (1, 8)),   # P(B < 2) = 9/256 > 2.5 %
    (9, (2, 8)),   # P(B < 2) = 10/512 <= 2.5 % < P(B < 3) = 46/512
    (10, (2, 9)),  # 11/1024 <= 2.5 % < 56/1024
    (20, (6, 15)),  # P(B < 6) = 21700/2^20 = 2.07 % <= 2.5 % < P(B < 7) = 5.77 % (the textbook x_(6), x_(15))
])
def test_median_interval_hand_computed(n: int, ranks: tuple[int, int] | None) -> None:
    xs = [10.0 * i for i in range(1, n + 1)]  # x_(i) = 10 i
    lo, hi = _median_ci(xs)
    if ranks is None:
        assert (lo, hi) == (-math.inf, math.inf)
    else:
        assert (lo, hi) == (10.0 * ranks[0], 10.0 * ranks[1])


@given(st.lists(st.floats(-50, 50), min_size=1, max_size=80))
def test_median_interval_is_the_widest_tail_within_bounds(values: list[float]) -> None:
    """Brute force: the interval's ranks are k and n + 1 - k for the largest k whose lower tail P(B < k) (B ~
    Binomial(n, 1/2), counted exactly over all 2^n outcomes' sizes) is at most 2.5 %; it holds the median."""
    xs, n = sorted(values), len(values)
    tail = [sum(math.comb(n, i) for i in range(k)) / 2 ** n for k in range(n + 1)]
    k = max((k for k in range(1, n + 1) if tail[k] <= 0.025), default=0)
    lo, hi = _median_ci(xs)
    assert (lo, hi) == ((xs[k - 1], xs[n - k]) if k else (-math.inf, math.inf))
    assert lo <= statistics.median(xs) <= hi


@pytest.mark.parametrize(("pairs", "target", "met"), [
    ([0.1, 0.2, 0.3, 0.5, 0.6, 0.9], 1.0, True),     # the interval (every pair, n = 6) within the target
    ([0.1, 0.2, 0.3, 0.5, 0.6, 1.1], 1.0, None),     # its top above: straddles
    ([1.2, 1.5, 2.0, 2.5, 3.0, 60.0], 1.0, False),   # the whole interval above
    ([0.9, 1.5, 2.0, 2.5, 3.0, 60.0], 1.0, None),
    ([-27.0, -25.3, -18.3, -8.0, -7.3, 11.6], 2.0, None),  # noise never makes a met
    ([0.1, 0.2, 0.3, 0.4, 0.5], 1.0, None),          # five pairs: no interval, no verdict
    ([-5.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 9.0], 1.0, True),  # n = 9: the extremes fall outside
])
def test_verdict(pairs: list[float], target: float, met: bool | None) -> None:
    assert _verdict(sorted(pairs), target) is met


@pytest.mark.parametrize(("pairs", "lower_bound", "met"), [
    (True, True, True), (None, True, None), (False, True, False),  # a bound within the target shows nothing met
    (True, False, False), (None, False, False), (False, False, False),  # a bound over it is a miss
    (True, None, True), (None, None, None), (False, None, False),  # no bound (not host-bound, or CPU): the pairs'
])
def test_combined_verdict(pairs: bool | None, lower_bound: bool | None, met: bool | None) -> None:
    assert _combined(pairs, lower_bound) is met


def test_quartiles_of_sorted_pairs() -> None:
    assert _quartiles([1.0, 2.0, 3.0]) == (1.0, 3.0)
    lo, hi = _quartiles([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
    assert lo == pytest.approx(2.25) and hi == pytest.approx(6.75)


@dataclass
class _Range:
    start: float
    end: float


@dataclass
class _Event:
    name: str
    time_range: _Range
    device_type: torch.autograd.DeviceType = torch.autograd.DeviceType.CUDA


def _ev(name: str, a: float, b: float, cpu: bool = False) -> _Event:
    dt = torch.autograd.DeviceType.CPU if cpu else torch.autograd.DeviceType.CUDA
    return _Event(name, _Range(a, b), dt)


def test_timeline_steps_between_markers() -> None:
    """Two turns with work and one without: spans between the markers, busy = union of the overlapping kernels, the
    canary's kernels summed; a CPU event and the markers themselves are not work."""
    events = [_ev(MARK, 0, 1), _ev("gemm", 2, 4), _ev("void kvcanary::write_kernel<1>", 3, 5), _ev("copy", 6, 7),
              _ev("host op", 2, 9, cpu=True), _ev(MARK, 10, 11),
              _ev(MARK, 20, 21), _ev(MARK, 22, 23),  # a turn that ran no batch
              _ev(MARK, 30, 31), _ev("kvcanary::plan", 32, 33), _ev("kvcanary::verify", 33, 36), _ev(MARK, 40, 41)]
    rows = timeline_steps(events)
    assert rows == [{"wall_us": 9, "gpu_busy_us": 4, "canary_gpu_us": 2, "canary_kernels": 1},
                    {"wall_us": 9, "gpu_busy_us": 4, "canary_gpu_us": 4, "canary_kernels": 2}]


def test_timeline_steps_refuse_an_unpaired_marker() -> None:
    with pytest.raises(RuntimeError, match="3 step markers"):
        timeline_steps([_ev(MARK, 0, 1), _ev("gemm", 2, 4), _ev(MARK, 10, 11), _ev(MARK, 20, 21)])


@given(st.lists(st.tuples(st.integers(0, 60), st.integers(1, 20)), max_size=12))
def test_union_counts_each_busy_unit_once(spans: list[tuple[int, int]]) -> None:
    intervals = [(float(a), float(a + d)) for a, d in spans]
    covered = {u for a, d in spans for u in range(a, a + d)}
    assert _union_us(intervals) == len(covered)


def _run(pairs: list[float], att: list[float] | None = None, vs: list[float] | None = None,
         host_bound: bool = True) -> dict[str, object]:
    """A bench_transformers JSON of one variant (target 1 %) and the control, with these per-step lists."""
    variant: dict[str, object] = {"config": "v", "overhead_pct": statistics.median(pairs), "pairs_pct": pairs,
                                  "target_pct": 1.0, "met_attributed": True if host_bound else None}
    if att is not None:
        variant["attributed_pct"] = att
    if vs is not None:
        variant["pairs_vs_control_pct"] = vs
    control = {"config": "c", "overhead_pct": 0.0, "pairs_pct": [0.0] * len(pairs)}
    return {"rows": [{"config": "baseline", "decode_step_ms": 60.0}, control, variant]}


def test_pooled_runs_are_one_run_of_all_their_pairs() -> None:
    """Two runs of five pairs each have no interval alone; pooled, the ten pairs give the interval of x_(2), x_(9)
    (hand-computed above) and a verdict; the bound's quartiles and the pairs against the control pool the same way."""
    a, b = [0.1, 0.5, 0.2, 0.9, 0.3], [0.4, 0.8, 0.0, 0.6, 0.7]
    rows = {r["config"]: r for r in pool({"a": _run(a, att=a, vs=b), "b": _run(b, att=b, vs=a)})}
    v = rows["v"]
    both = sorted(a + b)
    assert v["runs"] == 2 and v["step_pairs"] == 10 and v["run_overheads_pct"] == [0.3, 0.6]
    assert v["overhead_pct"] == round(statistics.median(both), 2) and v["overhead_ci95_pct"] == [both[1], both[8]]
    assert v["met_pairs"] is True and v["met"] is True  # x_(9) = 0.8 <= 1 %
    assert v["attributed_upper_quartile_pct"] == round(_quartiles(both)[1], 3) and v["met_attributed"] is True
    assert v["overhead_vs_control_ci95_pct"] == [both[1], both[8]] and v["met_vs_control"] is True
    assert rows["c"] == {"config": "c", "runs": 2, "step_pairs": 10, "overhead_pct": 0.0,
                         "overhead_ci95_pct": [0.0, 0.0], "run_overheads_pct": [0.0, 0.0]}


def test_pooled_verdicts_follow_the_pairs_and_the_bound() -> None:
    """Pairs above the target miss; a bound over the target misses whatever the pairs say; a run not profiled as
    host-bound leaves the bound out of the verdict."""
    high = [1.5 + 0.1 * i for i in range(10)]
    low = [0.1 * i for i in range(10)]
    assert pool({"a": _run(high)})[1]["met"] is False
    over = pool({"a": _run(low, att=[2.0] * 10)})[1]
    assert over["met_pairs"] is True and over["met_attributed"] is False and over["met"] is False
    unprofiled = pool({"a": _run(low, att=[2.0] * 10), "b": _run(low, att=[2.0] * 10, host_bound=False)})[1]
    assert unprofiled["met_attributed"] is None and unprofiled["met"] is True


def test_pooling_refuses_runs_it_cannot_pool() -> None:
    """A run written before the per-step lists were kept, and runs that disagree on a config's target."""
    old = _run([0.1] * 6)
    del old["rows"][2]["pairs_pct"]  # type: ignore[index]
    with pytest.raises(PoolError, match="old.json"):
        pool({"new.json": _run([0.1] * 6), "old.json": old})
    other = _run([0.1] * 6)
    other["rows"][2]["target_pct"] = 2.0  # type: ignore[index]
    with pytest.raises(PoolError, match="targets"):
        pool({"a": _run([0.1] * 6), "b": other})

