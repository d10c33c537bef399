"""Sweep: cached chains verified with fingerprints, unlocked filter, SWA residency, completion counted late."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from kvcanary.config import CanaryConfig
from kvcanary.manager import CanaryManager, install
from kvcanary.sweep import Sweeper
from kvcanary_schema import CounterCol, FailReason, LaunchTag, RecordField, Stage

from .fake_engine import FakeEngine
from .helpers import run, setup, step, total, violations


def test_sweep_catches_idle_cached_corruption_only_by_sweep() -> None:
    eng, m = setup(n_reqs=0, fingerprint="all", sweep_interval=3)
    eng.add("a", [1, 2, 3, 4])
    eng.add("b", [5, 6, 7])
    run(eng, m, 2)
    eng.finish("a")
    slot = eng.cache[0].slots[1]
    eng.kv[1][0][slot, 0] += 1.0  # V of layer 0 of a cached, idle slot
    reports = run(eng, m, 3)  # forward 3 sweeps; nothing else reads that slot
    vs = violations(reports)
    assert vs and all(v.tag.stage == Stage.SWEEP and v.reasons == FailReason.VERIFY_FINGERPRINT for v in vs)
    assert {v.slot for v in vs} == {slot} and all(v.request_id is None for v in vs)


def test_unlocked_only_filter() -> None:
    for unlocked_only, expect in ((False, True), (True, False)):
        eng, m = setup(n_reqs=0, sweep_unlocked_only=unlocked_only)
        eng.add("a", [1, 2, 3, 4])
        run(eng, m, 1)
        eng.finish("a")
        eng.add("a2", [1, 2, 3, 4, 5])  # holds a's chain: locked
        assert m.state.pool.groups[0] is not None
        chain = eng.cache[0]
        assert chain.locks == 1
        m.state.groups[0].tail.records[chain.slots[0], 0, RecordField.POSITION] += 3
        assert m.sweep()
        rep = m.flush()
        assert rep is not None
        assert any(v.tag.stage == Stage.SWEEP for v in rep.violations) == expect


def test_completed_sweeps_counted_after_results() -> None:
    eng, m = setup(n_reqs=1, sweep_interval=2, report_interval=4)
    eng.finish("r0")
    eng.add("r1", [3, 4, 5])
    step(eng, m)
    step(eng, m)  # sweep launched here, window not reported yet
    assert m.sweeper.launched == 1 and m.sweeps_completed == 0
    step(eng, m)
    step(eng, m)  # window staged and collected: two sweeps' results known
    assert m.sweeper.launched == 2 and m.sweeps_completed == 2


def test_on_demand_sweep_and_chunking() -> None:
    eng = FakeEngine()
    m = install(eng, CanaryConfig(sweep_capacity=2, stats_interval=0, sweep_interval=0, sweep_slice=0, seal=False))
    for i in range(5):
        eng.add(f"c{i}", [20 + i, 30 + i, 40 + i])
    run(eng, m, 1)
    for i in range(5):
        eng.finish(f"c{i}")
    assert m.sweep()
    rep = m.flush()
    assert rep is not None and rep.total == 0
    from kvcanary_schema import CounterCol, LaunchTag
    c = m.state.sink.counters
    assert int(c[LaunchTag.SWEEP_K_FULL, CounterCol.VERIFY_RUNS]) == 3  # ceil(5 chains / capacity 2)
    assert int(c[LaunchTag.SWEEP_K_FULL, CounterCol.ENTRIES_CHECKED]) == 15
    assert not m.health.problems


def test_swa_group_clean_with_eviction_and_sweeps() -> None:
    eng = FakeEngine(swa_window=3)
    m = install(eng, CanaryConfig(fingerprint="all", sweep_interval=2, stats_interval=0, mode="raise"))
    eng.add("a", [1, 2, 3, 4, 5, 6])
    eng.add("b", [7, 8, 9])
    run(eng, m, 4)
    eng.finish("a")
    reports = run(eng, m, 4)
    assert total(reports) == 0
    from kvcanary_schema import CounterCol, LaunchTag
    c = m.state.sink.counters
    assert int(c[LaunchTag.SWEEP_K_SWA, CounterCol.SKIPPED]) > 0  # evicted SWA slots skipped, not flagged
    assert int(c[LaunchTag.HEAD_K_SWA, CounterCol.ENTRIES_CHECKED]) > 0
    assert int(c[LaunchTag.HEAD_K_FULL, CounterCol.ENTRIES_CHECKED]) > int(c[LaunchTag.HEAD_K_SWA,
                                                                                CounterCol.ENTRIES_CHECKED])


def test_swa_corruption_inside_window_reported_with_swa_tag() -> None:
    eng = FakeEngine(swa_window=3)
    m = install(eng, CanaryConfig(fingerprint="all", stats_interval=0, sweep_interval=0))
    eng.add("a", [1, 2, 3, 4, 5, 6])
    run(eng, m, 1)
    r = eng.reqs["a"]
    t = int(eng.req_to_token[r.row, r.kv_len - 2])
    g = int(eng.swa_map[t])  # type: ignore[index]
    assert eng.swa_kv is not None
    eng.swa_kv[0][0][g, 1] += 0.5
    vs = violations(run(eng, m, 1))
    assert vs and {v.tag.name for v in vs} == {"TAIL_K_SWA"} and vs[0].slot == g


def test_empty_export_sweep_is_a_launch() -> None:
    eng, m = setup(n_reqs=0)
    assert m.sweep(Sweeper.empty_export(torch.device("cpu")))
    m.flush()
    assert not m.health.problems


def _five_cached(**config: Any) -> tuple[FakeEngine, CanaryManager]:
    """Five four-token chains cached after one forward (slice 8 of the fake engine's 96 slot ids)."""
    eng = FakeEngine()
    m = install(eng, CanaryConfig(stats_interval=0, sweep_slice=8, **config))
    for i in range(5):
        eng.add(f"c{i}", [20 + i, 30 + i, 40 + i, 50 + i])
    run(eng, m, 1)
    for i in range(5):
        eng.finish(f"c{i}")
    return eng, m


def _one_token_forward(eng: FakeEngine, m: CanaryManager, k: int) -> None:
    """A forward of a one-token request: the bracket goes on without touching the cache."""
    eng.add(f"t{k}", [7])
    run(eng, m, 1)
    eng.finish(f"t{k}", cache=False)


def _cached_tokens(eng: FakeEngine) -> int:
    export = eng.prefix_cache_export()
    assert export is not None
    return int(export.lens.sum())


@pytest.mark.parametrize("every", [1, 3, 4])
def test_rolling_sweep_covers_every_cached_slot_once_per_pass(every: int) -> None:
    """slice 8 of 96 slot ids, a slice of 8 x ``every`` ids every ``every`` forwards: after 12 forwards every cached
    slot was verified exactly once (K and V, TAIL and the HEAD seal), only forwards ``every`` divides verify, and none
    more than its slice."""
    eng, m = _five_cached(sweep_roll_interval=every)
    checked = m.state.sink.counters[LaunchTag.SWEEP_K_FULL, CounterCol.ENTRIES_CHECKED]
    per_forward = {}
    for k in range(-(-eng.num_slots // 8)):
        before = int(checked)
        _one_token_forward(eng, m, k)
        per_forward[m.forwards] = int(checked) - before
    assert sum(per_forward.values()) == 2 * _cached_tokens(eng)  # TAIL records + HEAD seal, each cached slot once
    assert all(n == 0 for f, n in per_forward.items() if f % every)
    assert max(per_forward.values()) <= 2 * 8 * every
    assert m.sweeper.slices == 12 // every  # the loop's (forward 1 found nothing cached yet)
    assert not m.health.problems and all(r.total == 0 for r in m.reports)


def test_rolling_slice_never_walks_past_the_pool() -> None:
    """A slice wider than the pool (8 x 16 ids of 96) walks the pool once: each cached slot is verified once per
    slice, not twice."""
    eng, m = _five_cached(sweep_roll_interval=16)
    assert m.sweeper.chain_out.shape[0] == eng.num_slots
    checked = m.state.sink.counters[LaunchTag.SWEEP_K_FULL, CounterCol.ENTRIES_CHECKED]
    before = int(checked)
    for k in range(15):  # forward 16 rolls
        _one_token_forward(eng, m, k)
    assert m.sweeper.slices == 1
    assert int(checked) - before == 2 * _cached_tokens(eng)


def _rolled_counters(garbage: bool) -> torch.Tensor:
    """Counters after a rolling pass over five cached chains; ``garbage``: the inverse map scrambled first."""
    eng, m = _five_cached(sweep_roll_interval=4)
    if garbage:  # before the first slice (forward 4): indices of the export that hold other slots, and past it
        inv = m.state.sweep_inv
        inv.copy_(torch.randint(0, 6, inv.shape, generator=torch.Generator().manual_seed(1)))
        inv[::7] = 12345
    for k in range(-(-eng.num_slots // 8)):
        _one_token_forward(eng, m, k)
    assert not m.health.problems and all(r.total == 0 for r in m.reports)
    return m.state.sink.counters.clone()


def test_rolling_sweep_warm_up_at_install_leaves_nothing_behind() -> None:
    """install derives once from a one-slot export (CUDA loads the derive's kernels then, not in a forward): slot 0
    maps to entry 0, nothing else is written and nothing is kept; whatever a derive leaves, a slice of a later export
    ignores where that export does not hold the slot."""
    eng = FakeEngine()
    m = install(eng, CanaryConfig(stats_interval=0, sweep_slice=8))
    inv = m.state.sweep_inv
    assert m.sweeper._derived is None and not bool(inv.any())
    assert torch.equal(_rolled_counters(garbage=True), _rolled_counters(garbage=False))
