"""The eager stages launched from CUDA graphs (program.EagerGraphs): the same records, counters, phases and reports as
launching each kernel, one graph per (stage, shape, slot table), and the fallbacks (off, CPU, capture failure)."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from kvcanary.manager import CanaryManager
from kvcanary.report import Violation
from kvcanary_schema import Stage

from .fake_engine import FakeEngine
from .helpers import setup, step

N_REQS = 4


def gpu(test: object) -> object:
    """GPU-only: marked for the GPU suite, skipped without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


def _make(device: str, **cfg: object) -> tuple[FakeEngine, CanaryManager]:
    eng = FakeEngine(num_slots=512, req_rows=8, max_context=96, device=device, swa_window=cfg.pop("swa", 0))  # type: ignore[arg-type]
    return setup(N_REQS, 6, eng, backend=device, report_interval=1, **cfg)


def _corrupt(eng: FakeEngine, k: int) -> None:
    """Change one cached slot's K bytes in the first layer (the per-forward fingerprint's bytes)."""
    r = list(eng.reqs.values())[k % len(eng.reqs)]
    eng.kv[0][0][int(eng.req_to_token[r.row, k % 5])] += 1.0


def _state(m: CanaryManager) -> list[torch.Tensor]:
    torch.cuda.synchronize()
    return [t.cpu() for g in m.state.groups for t in (g.head.records, g.tail.records)] + \
        [m.state.sink.counters.cpu(), m.state.phase.cpu()]


def _run_pair(cfg: dict[str, object], steps: int = 40, churn: bool = False) -> tuple[CanaryManager, CanaryManager]:
    """The same workload with eager graphs on (b) and off (a): faults every few forwards, requests finishing and new
    ones reusing their cached prefixes (``churn``: new shapes, the reuse check's stage variant)."""
    (ea, ma), (eb, mb) = _make("cuda", **cfg, eager_graphs=False), _make("cuda", **cfg)
    for k in range(steps):
        for e, m in ((ea, ma), (eb, mb)):
            if k % 6 == 4:
                _corrupt(e, k)
            if churn and k % 7 == 5:
                e.finish(next(iter(e.reqs)))
                e.add(f"n{k}", [*e.cache[-1].tokens, 7 + k])
            step(e, m)
    ma.flush()
    mb.flush()
    return ma, mb


def _row(v: Violation) -> tuple[tuple[str, object], ...]:
    """A row as comparable items. A sweep row's chain is left out: this engine's export repeats the slots of shared
    prefixes, and which of a repeated slot's chains the rolling sweep names is any one (docs/ops-contract.md 3a)."""
    return tuple((k, x) for k, x in v.to_dict().items() if not (k == "chain" and v.tag.stage == Stage.SWEEP))


def _assert_same(ma: CanaryManager, mb: CanaryManager) -> None:
    for x, y in zip(_state(ma), _state(mb), strict=True):
        assert torch.equal(x, y)
    rows = [sorted(_row(v) for r in m.reports for v in r.violations) for m in (ma, mb)]
    assert rows[0] == rows[1] and rows[0], "the faults must be found, the same way"
    assert [r.total for r in ma.reports] == [r.total for r in mb.reports]
    assert not ma.health.problems and not mb.health.problems


@pytest.mark.parametrize("cfg", [{}, {"fingerprint": "all", "half_coverage": "each"}, {"swa": 16},
                                 {"coverage": "window", "stripe_size": 3}, {"token_truth": "pool"}])
@pytest.mark.parametrize("churn", [False, True])
@gpu
def test_graphs_equal_direct_launches(cfg: dict[str, object], churn: bool) -> None:
    ma, mb = _run_pair(dict(cfg), churn=churn)
    _assert_same(ma, mb)
    assert ma.program.graphs is None
    graphs = mb.program.graphs
    assert graphs is not None and graphs.enabled and len(graphs.graphs) >= 2  # decode's pre and post at least


@gpu
def test_one_graph_per_stage_shape_and_table() -> None:
    """A stage is captured on its ``capture_after``-th run; another slot table (same shape, new address) gets its own
    graph, and the old one never runs with it."""
    eng, m = _make("cuda")
    graphs = m.program.graphs
    assert graphs is not None
    n = graphs.capture_after
    for _ in range(n):  # the prefill, then n - 1 decodes: launched directly
        step(eng, m)
    assert not graphs.graphs
    step(eng, m)
    assert len(graphs.graphs) == 2  # pre and post at the decode shape
    for _ in range(3):
        step(eng, m)
    assert len(graphs.graphs) == 2
    old = eng.req_to_token
    eng.req_to_token = old.clone()  # the engine moves its slot table
    for _ in range(n + 2):
        step(eng, m)
    assert len(graphs.graphs) == 4
    assert {k[2] for k in graphs.graphs} == {old.data_ptr(), eng.req_to_token.data_ptr()}
    m.flush()
    assert not m.health.problems and sum(r.total for r in m.reports) == 0


@gpu
def test_capture_failure_falls_back_to_direct_launches(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A capture that fails (here: a sync inside it) logs once, turns the graphs off and the forward still runs."""
    import kvcanary.program as program

    real_run = program.run

    def syncing_run(*args: object) -> None:
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()  # illegal while capturing: the capture fails
        real_run(*args)  # type: ignore[arg-type]
    ea, ma = _make("cuda", eager_graphs=False)
    eb, mb = _make("cuda")
    monkeypatch.setattr(program, "run", syncing_run)
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        for k in range(20):
            for e, m in ((ea, ma), (eb, mb)):
                if k == 18:
                    _corrupt(e, k)
                step(e, m)
    ma.flush()
    mb.flush()
    graphs = mb.program.graphs
    assert graphs is not None and not graphs.enabled and not graphs.graphs
    assert sum("capturing an eager stage failed" in r.message for r in caplog.records) == 1
    _assert_same(ma, mb)


@gpu
def test_eager_forward_inside_an_engine_capture_is_not_captured_twice() -> None:
    """An engine that captures forwards it declared eager: the stages join its graph (no graph launched or captured
    inside it), whether their key has a graph or not."""
    eng, m = _make("cuda")
    graphs = m.program.graphs
    assert graphs is not None
    for _ in range(graphs.capture_after + 1):
        step(eng, m)
    before = dict(graphs.graphs)
    assert len(before) == 2
    for moved in (False, True):
        if moved:
            eng.req_to_token = eng.req_to_token.clone()  # a key not captured yet, due at once
            graphs.capture_after = 1
        b = eng.batch()
        m.begin_forward(b)
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.cuda.graph(g, stream=side):
            m.pre_forward()
            m.post_forward()
        torch.cuda.current_stream().wait_stream(side)
        m.end_forward()
        assert graphs.graphs == before and graphs.enabled


def test_cpu_has_no_graphs() -> None:
    _, m = _make("cpu")
    assert m.program.graphs is None


@pytest.mark.parametrize("fails", [None, RuntimeError, TypeError, AttributeError])
def test_the_pool_routing_guard_ends_the_routing_and_never_raises(fails: type[Exception] | None,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """program._end_pool_routing asks torch to end the routing to the failed capture's pool, on its device; a torch
    that has ended it already (RuntimeError) or whose private binding differs does not turn the fallback into an
    error."""
    import kvcanary.program as program

    calls: list[tuple[object, ...]] = []

    def end(*args: object) -> None:
        calls.append(args)
        if fails is not None:
            raise fails("from the binding")
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end, raising=False)
    program._end_pool_routing(3, (0, 7))
    assert calls == [(3, (0, 7))]


# a failed capture of an eager stage (a sync inside it), then a memory pool torn down, then the interpreter's exit
_FAILED_CAPTURE_THEN_POOL = textwrap.dedent("""
    import torch
    import kvcanary.program as program
    from tests.runtime.test_eager_graphs import _make
    from tests.runtime.helpers import step

    real_run = program.run

    def syncing_run(*args):
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()
        real_run(*args)

    program.run = syncing_run
    eng, m = _make("cuda")
    for _ in range(20):
        step(eng, m)
    assert not m.program.graphs.enabled
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        x = torch.ones(1024, device="cuda")
    del x, pool
    torch.cuda.synchronize()
    print("clean exit")
""")


@gpu
def test_a_failed_capture_leaves_torchs_allocator_able_to_tear_down_pools() -> None:
    """After the fallback, tearing down a memory pool and exiting do not abort the process: torch (before
    pytorch#180395) leaves its allocator routing to a failed capture's pool, which program._end_pool_routing ends.
    In a subprocess: the failure it guards against is an abort."""
    got = subprocess.run([sys.executable, "-c", _FAILED_CAPTURE_THEN_POOL], capture_output=True, text=True,
                         timeout=300, check=False, cwd=Path(__file__).parents[2])
    assert got.returncode == 0 and "clean exit" in got.stdout, got.stderr[-3000:]
