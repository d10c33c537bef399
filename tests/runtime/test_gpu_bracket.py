"""GPU: the bracket's device parts captured in CUDA graphs, replayed over changing batches, equal to eager."""

from __future__ import annotations

import pytest
import torch
from kvcanary.config import CanaryConfig
from kvcanary.manager import CanaryManager, install
from kvcanary.streams import CurrentStream
from kvcanary_schema import CarryHeaderCol, CounterCol, FailReason, RecordField, Stage

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


def _capture(eng: FakeEngine, m: CanaryManager) -> tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph]:
    """Capture one decode bracket: the pre and post device parts, each in its own graph (the batch is not run)."""
    free = list(eng.free)
    cap = eng.batch()
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    pre_g, post_g = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    m.begin_forward(cap, kind="capture")
    with torch.cuda.stream(side):
        with torch.cuda.graph(pre_g, stream=side):
            m.pre_forward()
        with torch.cuda.graph(post_g, stream=side):
            m.post_forward()
    torch.cuda.current_stream().wait_stream(side)
    m.end_forward()
    for r in eng.reqs.values():  # the capture batch was never run: undo its allocation
        eng.req_to_token[r.row, r.kv_len:] = 0
    eng.free = free
    return pre_g, post_g


def _replay(eng: FakeEngine, m: CanaryManager, graphs: tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph]) -> None:
    b = eng.batch()
    m.begin_forward(b, kind="replay")
    graphs[0].replay()
    eng.forward(b)
    graphs[1].replay()
    m.end_forward()


def _rows(m: CanaryManager) -> list[tuple[tuple[str, object], ...]]:
    return sorted(tuple(v.to_dict().items()) for r in m.reports for v in r.violations)


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
    graphs = _capture(eb, mb)
    for k in range(steps):
        if k % 5 == 3:
            _corrupt(ea, ma, k)
            _corrupt(eb, mb, k)
        _eager(ea, ma)
        _replay(eb, mb, graphs)
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
    rows_a, rows_b = _rows(ma), _rows(mb)
    assert rows_a == rows_b and len(rows_a) > 0
    assert [r.total for r in ma.reports] == [r.total for r in mb.reports]
    assert not mb.health.problems and not ma.health.problems


def test_captured_reuse_check_catches_a_corrupted_cached_prefix() -> None:
    """A request admitted between replays reuses a cached chain whose V bytes (last layer) changed after the seal:
    the captured post stage (the seal on a graph branch, the reuse check after the TAIL write) reports it in that
    replay, as the eager twin does; the decode-shaped batch replays the graph captured before."""
    ea, ma = _make({"report_interval": 1})
    eb, mb = _make({"report_interval": 1})
    for e, m in ((ea, ma), (eb, mb)):
        _eager(e, m)
        _eager(e, m)
    graphs = _capture(eb, mb)
    for e in (ea, eb):
        e.finish(f"r{N_REQS - 1}")
        cached = e.cache[-1]
        e.add("n", [*cached.tokens, 5])  # one new token: the captured (bs, tokens) shape
        e.kv[1][e.layers - 1][cached.slots[2], 0] += 1.0
    _eager(ea, ma)
    _replay(eb, mb, graphs)
    ma.flush()
    mb.flush()
    torch.cuda.synchronize()
    rows_a, rows_b = _rows(ma), _rows(mb)
    assert rows_a == rows_b
    hits = [v for r in mb.reports for v in r.violations if v.request_id == "n"]
    assert hits and all(v.tag.stage == Stage.TAIL and v.reasons & FailReason.VERIFY_FINGERPRINT for v in hits)


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


@pytest.mark.parametrize("graphed", [False, True])
def test_no_allocations_or_syncs_in_device_parts(graphed: bool) -> None:
    """Neither the direct launches nor, once the stages have their graphs (EagerGraphs), the graph launches."""
    eng, m = _make({"fingerprint": "all"})
    graphs = m.program.graphs
    assert graphs is not None
    for _ in range(1 + (graphs.capture_after + 1 if graphed else 1)):  # the prefill, then decodes
        _eager(eng, m)
    assert len(graphs.graphs) == (2 if graphed else 0)
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


@pytest.mark.parametrize("where", ["host", "device"])
def test_invalidate_takes_host_and_device_slots_without_allocating(where: str) -> None:
    """A freed slot's records are poisoned in both buffers (host ids through the launch's parameters), nothing is
    allocated, and the next forward reports the slot."""
    eng, m = _make({})
    _eager(eng, m)
    _eager(eng, m)
    g, r = m.state.groups[0], eng.reqs["r1"]
    slot, n = int(eng.req_to_token[r.row, 1]), g.spec.num_slots
    ids = torch.tensor([0, slot, -3, n, n + 7], dtype=torch.int32)  # slot 0 reserved, the others outside the pool
    ids = ids if where == "host" else ids.to("cuda")
    before = g.records.clone()
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_stats()["allocation.all.allocated"]
    m.invalidate(ids)
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocated
    assert (g.records != before).any(dim=3).any(dim=2).any(dim=0).nonzero().flatten().tolist() == [slot]
    assert bool((g.records[:, slot, :, RecordField.POSITION] == -1).all())
    _eager(eng, m)
    m.flush()
    hits = [v for rep in m.reports for v in rep.violations if v.slot == slot]
    assert hits and all(v.request_id == "r1" and FailReason.VERIFY_POSITION in v.reasons for v in hits)


def test_violation_window_is_staged_when_its_ring_count_arrives() -> None:
    eng, m = _make({})  # the default report_interval: forward 6 is mid-window
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
    eng, m = _make({"report_interval": 16})  # clean windows end inside the 40 forwards too
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
    assert all(r.total or r.last_step % m.config.report_interval == 0 for r in windows[:-1])
    assert sum(r.total for r in windows) == int(m.state.sink.counters[:, CounterCol.VIOLATIONS].sum()) > 0
    assert not m.health.problems


@pytest.mark.parametrize("cfg", [{}, {"fingerprint": "all"}, {"fingerprint": "none"}, {"seal": False}])
def test_long_prefills_take_the_look_back_and_match_the_reference(cfg: dict[str, object]) -> None:
    """Prefills of 1500-2600 tokens (their writes scan tiles through the look-back workspaces, which only the cuda
    backend allocates; without a seal the TAIL write takes the HEAD write's kept carries), then decodes: the cuda
    backend's records and reports equal the torch backend's on the GPU."""
    managers, engines = [], []
    for backend in ("cuda", "torch"):
        eng = FakeEngine(num_slots=8192, req_rows=4, max_context=2700, device="cuda")
        m = install(eng, CanaryConfig(backend=backend, stats_interval=0, sweep_interval=0, report_interval=1,
                                      token_capacity=4200, **cfg))  # type: ignore[arg-type]
        for i, n in enumerate((1500, 2600)):
            eng.add(f"r{i}", [(7 * j + i) % 30000 for j in range(n)])
        managers.append(m)
        engines.append(eng)
    group = managers[0].state.groups[0]
    assert (group.write_carries is not None) == (group.seal is None)
    for step in range(4):  # the prefill, then decodes
        for eng, m in zip(engines, managers, strict=True):
            _eager(eng, m)
        if step == 0 and group.write_carries is not None:  # the prefill's scan, kept and taken (disarmed)
            head = group.write_carries[0].tolist()
            assert [head[CarryHeaderCol.TOTAL], head[CarryHeaderCol.ARMED], head[CarryHeaderCol.DONE]] == [4100, 0, 0]
    ws = managers[0].state.groups[0].write_workspaces
    assert managers[1].state.groups[0].write_workspaces == (None, None)
    # used and restored (a TAIL write that took the kept carries scanned nothing: no tickets, the same generation)
    used = ws if group.write_carries is None else ws[:1]
    assert all(w is not None and w[:2].tolist() == [0, 0] for w in ws)
    assert all(w is not None and int(w[2]) >= 1 for w in used)
    for m in managers:
        m.flush()
    cuda, ref = (m.state.groups[0] for m in managers)
    assert torch.equal(cuda.head.records, ref.head.records) and torch.equal(cuda.tail.records, ref.tail.records)
    assert _rows(managers[0]) == _rows(managers[1]) == []


def test_current_stream_follows_torch() -> None:
    """CurrentStream.get() is the stream torch.cuda.current_stream() names, across a switch and back; an event recorded
    on it orders after work queued there."""
    cs, side = CurrentStream(torch.cuda.current_device()), torch.cuda.Stream()  # type: ignore[no-untyped-call]
    assert cs.get() == torch.cuda.current_stream()
    with torch.cuda.stream(side):
        assert cs.get() == side
        x = torch.ones(1 << 20, device="cuda")
        ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ev.record(cs.get())
        y = x * 2
    assert cs.get() == torch.cuda.current_stream() != side
    side.synchronize()  # type: ignore[no-untyped-call]
    assert ev.query() and int(y[0]) == 2  # type: ignore[no-untyped-call]
