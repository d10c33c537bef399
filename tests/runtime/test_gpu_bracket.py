"""GPU: the bracket's device parts captured in CUDA graphs, replayed over changing batches, equal to eager."""

from __future__ import annotations

import pytest
import torch
from kvcanary.config import CanaryConfig
from kvcanary.manager import CanaryManager, install
from kvcanary_schema import CounterCol, RecordField

from .fake_engine import FakeEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

N_REQS = 4


def _make(cfg: dict[str, object]) -> tuple[FakeEngine, CanaryManager]:
    eng = FakeEngine(num_slots=512, req_rows=8, max_context=96, device="cuda")
    m = install(eng, CanaryConfig(backend="cuda", stats_interval=0, sweep_interval=0, **cfg))  # type: ignore[arg-type]
    for i in range(N_REQS):
        eng.add(f"r{i}", [3 + 11 * i + j for j in range(6 + i)])
    return eng, m


def _eager(eng: FakeEngine, m: CanaryManager) -> None:
    b = eng.batch()
    m.begin_forward(b)
    m.pre_forward()
    eng.forward(b)
    m.post_forward()
    m.end_forward()


def _corrupt(eng: FakeEngine, m: CanaryManager, k: int, sign: int = 1) -> None:
    """Shift the stored position of one prefix slot (``sign`` -1: shift it back)."""
    r = eng.reqs[f"r{k % N_REQS}"]
    slot = int(eng.req_to_token[r.row, k % 5])
    m.state.groups[0].tail.records[slot, 0, RecordField.POSITION] += sign * (1000 + k)


@pytest.mark.parametrize("cfg", [{}, {"fingerprint": "all"}, {"coverage": "window", "stripe_size": 3},
                                 {"token_truth": "pool", "input_asserts": True}])
def test_graph_replay_equals_eager(cfg: dict[str, object]) -> None:
    steps = 24
    cfg = {"report_interval": 1, **cfg}  # a window per forward: the per-window totals below compare forwards
    ea, ma = _make(cfg)
    eb, mb = _make(cfg)
    for e, m in ((ea, ma), (eb, mb)):
        _eager(e, m)  # prefill (eager, different shapes) and one warm-up decode
        _eager(e, m)
    # capture one decode bracket of the graph engine: the pre and post device parts, each in its own graph
    free = list(eb.free)
    cap = eb.batch()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    pre_g, post_g = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    mb.begin_forward(cap, kind="capture")
    with torch.cuda.stream(side):
        with torch.cuda.graph(pre_g, stream=side):
            mb.pre_forward()
        with torch.cuda.graph(post_g, stream=side):
            mb.post_forward()
    torch.cuda.current_stream().wait_stream(side)
    mb.end_forward()
    for r in eb.reqs.values():  # the capture batch was never run: undo its allocation
        eb.req_to_token[r.row, r.kv_len:] = 0
    eb.free = free
    for k in range(steps):
        if k % 5 == 3:
            _corrupt(ea, ma, k)
            _corrupt(eb, mb, k)
        _eager(ea, ma)
        b = eb.batch()
        mb.begin_forward(b, kind="replay")
        pre_g.replay()
        eb.forward(b)
        post_g.replay()
        mb.end_forward()
    ra, rb = ma.flush(), mb.flush()
    del ra, rb
    torch.cuda.synchronize()
    sa, sb = ma.state, mb.state
    for ga, gb in zip(sa.groups, sb.groups, strict=True):
        assert torch.equal(ga.head.records, gb.head.records)
        assert torch.equal(ga.tail.records, gb.tail.records)
    # eager forwards skip the reuse check when no request is new, graphs always hold it: only VERIFY_RUNS may differ
    keep = [c for c in range(sa.sink.counters.shape[1]) if c != CounterCol.VERIFY_RUNS]
    assert torch.equal(sa.sink.counters[:, keep], sb.sink.counters[:, keep])
    assert torch.equal(sa.phase, sb.phase)
    rows_a = sorted(tuple(v.to_dict().items()) for r in ma.reports for v in r.violations)
    rows_b = sorted(tuple(v.to_dict().items()) for r in mb.reports for v in r.violations)
    assert rows_a == rows_b and len(rows_a) > 0
    assert [r.total for r in ma.reports] == [r.total for r in mb.reports]
    assert not mb.health.problems and not ma.health.problems


def test_replay_without_canary_ops_is_caught_by_phase_check() -> None:
    eng, m = _make({"mode": "log"})
    _eager(eng, m)
    _eager(eng, m)
    cap = eng.batch()
    pre_g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    m.begin_forward(cap, kind="capture")
    with torch.cuda.stream(side), torch.cuda.graph(pre_g, stream=side):
        m.pre_forward()
    m._phase = m._phase.__class__.POST  # an engine that forgot to capture the post part
    torch.cuda.current_stream().wait_stream(side)
    m.end_forward()
    for r in eng.reqs.values():
        eng.req_to_token[r.row, r.kv_len:] = 0
    b = eng.batch()
    m.begin_forward(b, kind="replay")
    pre_g.replay()  # the replay runs only the pre part
    eng.forward(b)
    m.end_forward()
    m.flush()
    kinds = {p.kind for p in m.health.problems}
    assert "phase" in kinds and "watchdog" in kinds


def test_no_allocations_or_syncs_in_device_parts() -> None:
    eng, m = _make({"fingerprint": "all"})
    _eager(eng, m)
    _eager(eng, m)
    b = eng.batch()
    m.begin_forward(b)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        m.pre_forward()
        m.post_forward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    after = torch.cuda.memory_stats()["allocation.all.allocated"]
    eng.forward(b)
    m.end_forward()
    assert after == before


def test_violation_window_is_staged_when_its_ring_count_arrives() -> None:
    eng, m = _make({})  # report_interval 16
    for _ in range(5):
        _eager(eng, m)
    _corrupt(eng, m, 3)
    _eager(eng, m)  # forward 6 emits rows; its end_forward copies the ring count out
    _corrupt(eng, m, 3, -1)
    torch.cuda.synchronize()
    _eager(eng, m)  # forward 7's begin_forward sees the count (if forward 6's end did not) and stages 1..6
    assert m.reporter.stagings == 1
    m.flush()
    bad = [r for r in m.reports if r.total]
    assert [(r.first_step, r.last_step) for r in bad] == [(1, 6)]
    assert {v.step for v in bad[0].violations} == {6}
    assert not m.health.problems


def test_alarm_windows_lose_no_rows_and_stage_no_empty_windows() -> None:
    """Bad forwards in pairs, no syncs: every staged window has rows or ends a report_interval (or is the flush's), and
    the windows' totals add up to the device's violation counters (a stale count would stage an empty window)."""
    eng, m = _make({})
    for k in range(40):
        bad = k % 9 in (4, 5)
        if bad:
            _corrupt(eng, m, k)
        _eager(eng, m)
        if bad:
            _corrupt(eng, m, k, -1)
    m.flush()
    torch.cuda.synchronize()
    windows = list(m.reports)
    assert windows[0].first_step == 1 and windows[-1].last_step == 40
    assert all(a.last_step + 1 == b.first_step for a, b in zip(windows, windows[1:], strict=False))
    assert all(r.total or r.last_step % 16 == 0 for r in windows[:-1])
    assert sum(r.total for r in windows) == int(m.state.sink.counters[:, CounterCol.VIOLATIONS].sum()) > 0
    assert not m.health.problems
