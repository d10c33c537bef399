"""CUDA backend vs the torch reference and the CPU backend, bit for bit: fuzz, large batches, graphs, bad input."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from kvcanary.errors import CanaryInputError
from kvcanary.ops.bookkeep import bind_bookkeep
from kvcanary.ops.fingerprint import fingerprint
from kvcanary.ops.invalidate import bind_invalidate, invalidate
from kvcanary.ops.plan import derive_roll, plan_forward, plan_roll, plan_sweep
from kvcanary.ops.scatter_tokens import scatter_tokens
from kvcanary.ops.slot_rows import SlotRowStager, slot_rows, stage_slot_rows
from kvcanary.ops.stage_batch import begin_decode, stage_batch
from kvcanary.ops.stage_window import stage_window
from kvcanary.ops.types import Fingerprint, FingerprintSources, GroupView, Sink, SourceSpec, TokenPool
from kvcanary.ops.verify import verify
from kvcanary.ops.write import write, write_carries, write_workspace
from kvcanary_schema import (
    INVALIDATE_INLINE_SLOTS,
    NUM_PLAN_COLS,
    NUM_PLAN_STATUS_COLS,
    RECORD_NUM_FIELDS,
    STAGE_INLINE_ROWS,
    TOKEN_LIMIT,
    CarryCol,
    CarryHeaderCol,
    CounterCol,
    FingerprintMode,
    PlanCol,
    PlanStatusCol,
    RecordField,
    Stage,
    WriteCheck,
)

from .helpers import (
    ALL_CHECKS,
    assert_brackets_equal,
    assert_sinks_equal,
    clone_group,
    consistent_entry_offsets,
    fp_to,
    group_to,
    make_batch,
    pool_to,
    run_bracket,
    sources_to,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CUDA = "cuda"


# ---- small scenarios of the CPU suites, moved to the GPU ---------------------------------------------------------

def _verify_small(seed: int, arbitrary: bool) -> None:
    import test_verify as TV  # noqa: PLC0415 (the CPU suite's generator, on sys.path via helpers)

    rng = random.Random(seed)
    sc = TV.make_scenario(rng)
    if arbitrary:
        TV.random_plan(rng, sc)
        consistent_entry_offsets(sc.plan, sc.status)
    outs = {}
    hint = rng.choice([0, 1, 2, 7, 1 << 20])  # the grid hint, right or wrong, changes no result
    for backend, dev in (("cpu", "cpu"), ("cuda", CUDA), ("torch", CUDA)):
        group = group_to(sc.group, dev)
        sink = Sink.allocate(4096, dev)
        sink.step.fill_(7)
        verify(group, sc.stage, sc.plan.to(dev), sc.status.to(dev), sc.table.to(dev), sink,
               token_pool=pool_to(sc.pool, dev), fingerprint=fp_to(sc.fp, dev), max_segment_entries=hint,
               backend=backend)
        assert torch.equal(group.records.cpu(), sc.group.records), f"{backend} verify mutated records"
        outs[backend] = sink
    assert_sinks_equal(outs["cuda"], outs["cpu"], f"seed {seed} cuda vs cpu")
    assert_sinks_equal(outs["cuda"], outs["torch"], f"seed {seed} cuda vs torch")


@pytest.mark.parametrize("seed", range(120))
def test_verify_small_scenarios(seed: int) -> None:
    _verify_small(seed, arbitrary=False)


@pytest.mark.parametrize("seed", range(60))
def test_verify_arbitrary_plans(seed: int) -> None:
    _verify_small(10_000 + seed, arbitrary=True)


@pytest.mark.parametrize("seed", range(120))
def test_write_small_cases(seed: int) -> None:
    import test_write as TW  # noqa: PLC0415

    rng = random.Random(seed)
    case = TW.make_case(seed, halves=rng.choice([1, 2]), swa=rng.random() < 0.4, fp=rng.random() < 0.4,
                        checks=rng.choice([0, ALL_CHECKS, 1, 2]), pool=rng.random() < 0.6, i32=rng.random() < 0.3,
                        bad=rng.choice([0.0, 0.1, 0.4]))
    outs = {}
    for backend, dev in (("cpu", "cpu"), ("cuda", CUDA), ("torch", CUDA)):
        group = group_to(case.group, dev)
        sink = Sink.allocate(4096, dev)
        sink.step[0] = 17
        sink.count[0] = 2
        write(group, case.stage, case.plan.to(dev), case.status.to(dev), case.table.to(dev), case.ids.to(dev),
              case.pos.to(dev), case.loc.to(dev), sink, checks=case.checks, token_pool=pool_to(case.pool, dev),
              fingerprint=fp_to(case.fp, dev), backend=backend)
        outs[backend] = (group.records.cpu(), sink)
    for other in ("cpu", "torch"):
        assert torch.equal(outs["cuda"][0], outs[other][0]), f"seed {seed}: records vs {other}"
        assert_sinks_equal(outs["cuda"][1], outs[other][1], f"seed {seed} vs {other}", skip=2)


@pytest.mark.parametrize("seed", range(66))
def test_plan_ops_match(seed: int) -> None:
    rng = random.Random(seed)
    bs = rng.choice([0, 1, 7, 64, 65, 128, 200, 256, 257, 513, 1500])  # each plan block width and its edges
    R, L = max(1, bs // 2 + 3), rng.randint(1, 300)
    table = torch.randint(-2, R * L, (R, L), dtype=rng.choice([torch.int32, torch.int64]))
    rpi = torch.randint(-1, R + 1, (bs,))
    pre = torch.randint(-1, L + 1, (bs,))
    ext = torch.randint(-1, 8, (bs,))
    num_tokens = int(ext.clamp(min=0).sum()) - rng.choice([0, 0, 3])
    kw = {"window": rng.choice([0, 0, 5, 64]), "padding_row": rng.choice([-1, 0]),
          "expect_prefix": torch.randint(-2**62, 2**62, (bs,)) if rng.random() < 0.5 else None,
          "expect_new": torch.randint(-2**62, 2**62, (bs,)) if rng.random() < 0.5 else None,
          "flag_mask": torch.randint(-2**62, 2**62, (bs,)) if rng.random() < 0.5 else None,
          "tick": torch.randint(-9, 9, (rng.randint(0, 3),)) if rng.random() < 0.5 else None}
    outs = {}
    for backend, dev in (("cpu", "cpu"), ("cuda", CUDA), ("torch", CUDA)):
        plan = torch.full((bs + 2, NUM_PLAN_COLS), -9, dtype=torch.int64, device=dev)
        status = torch.full((NUM_PLAN_STATUS_COLS,), -9, dtype=torch.int64, device=dev)
        # a copy: .to() would alias the CPU tensors, and tick is written in place
        kwd = {k: (v.clone().to(dev) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        plan_forward(plan, status, rpi.to(dev), pre.to(dev), ext.to(dev), table.to(dev), max(0, num_tokens),
                     backend=backend, **kwd)
        outs[backend] = (plan.cpu(), status.cpu(), None if kwd["tick"] is None else kwd["tick"].cpu())
    for other in ("cpu", "torch"):
        n = int(outs[other][1][PlanStatusCol.NUM_SEGMENTS])
        assert torch.equal(outs["cuda"][1], outs[other][1]), other
        assert torch.equal(outs["cuda"][0][:n], outs[other][0][:n]), other
    if kw["tick"] is not None:  # the stage counter: once per call on every backend
        assert all(torch.equal(o[2], kw["tick"] + 1) for o in outs.values())
    # plan_sweep
    n_chains = rng.choice([0, 3, 700, 2000])
    N = rng.randint(0, 5000)
    slots = torch.randint(0, 100, (N,))
    starts = torch.randint(-1, N + 2, (n_chains,))
    lens = torch.randint(-1, 50, (n_chains,))
    firsts = torch.randint(-1, 1000, (n_chains,))
    prevs = torch.randint(-1, 100, (n_chains,))
    ee = torch.randint(-2**62, 2**62, (n_chains,)) if rng.random() < 0.5 else None
    souts = {}
    for backend, dev in (("cpu", "cpu"), ("cuda", CUDA)):
        plan = torch.full((n_chains + 1, NUM_PLAN_COLS), -9, dtype=torch.int64, device=dev)
        status = torch.full((NUM_PLAN_STATUS_COLS,), -9, dtype=torch.int64, device=dev)
        plan_sweep(plan, status, slots.to(dev), starts.to(dev), lens.to(dev), firsts.to(dev), prevs.to(dev),
                   expect_end=None if ee is None else ee.to(dev), backend=backend)
        souts[backend] = (plan.cpu(), status.cpu())
    n = int(souts["cpu"][1][PlanStatusCol.NUM_SEGMENTS])
    assert torch.equal(souts["cuda"][1], souts["cpu"][1])
    assert torch.equal(souts["cuda"][0][:n], souts["cpu"][0][:n])


def test_plan_tick_replays_in_a_graph() -> None:
    """A captured plan with the stage counter (and the reuse plan's block): each replay ticks once."""
    plan = torch.zeros(4, NUM_PLAN_COLS, dtype=torch.int64, device=CUDA)
    rplan = torch.zeros_like(plan)
    status, rstatus = (torch.zeros(NUM_PLAN_STATUS_COLS, dtype=torch.int64, device=CUDA) for _ in range(2))
    rpi, pre, ext = (torch.tensor(v, device=CUDA) for v in ([0, 1], [1, 2], [1, 1]))
    table = torch.arange(10, dtype=torch.int32, device=CUDA).view(2, 5)
    tick = torch.tensor([7, 0], device=CUDA)
    side, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        plan_forward(plan, status, rpi, pre, ext, table, 2, reuse=(rplan, rstatus, pre.clone()), tick=tick,
                     backend="cuda")
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert tick.tolist() == [7, 0]  # capturing runs nothing
    for n in range(1, 4):
        graph.replay()
        torch.cuda.synchronize()
        assert tick.tolist() == [7 + n, n]


def _roll_outputs(e: Any, m: int, cursor: int, width: int, backend: str, dev: str) -> list[torch.Tensor]:
    """plan_roll of a test_plan_roll Export on ``backend``: plan rows in use, status, chain_out."""
    plan = torch.full((width + 1, NUM_PLAN_COLS), -9, dtype=torch.int64, device=dev)
    status = torch.full((NUM_PLAN_STATUS_COLS,), -9, dtype=torch.int64, device=dev)
    chain_out = torch.full((width,), -9, dtype=torch.int64, device=dev)
    t = {k: torch.tensor(getattr(e, k), dtype=torch.int64, device=dev) for k in
         ("slots", "starts", "lens", "ends", "firsts", "prevs", "inv")}
    un = e.unlocked
    plan_roll(plan, status, chain_out, t["slots"], t["starts"], t["lens"], t["ends"], t["firsts"], t["prevs"],
              t["inv"], m, cursor, unlocked=None if un is None else torch.tensor(un, dtype=torch.int64, device=dev),
              backend=backend)
    n = int(status[PlanStatusCol.NUM_SEGMENTS])
    return [plan[:n].cpu(), status.cpu(), chain_out.cpu()]


@pytest.mark.parametrize("seed", range(60))
def test_plan_roll_matches(seed: int) -> None:
    import test_plan_roll as TR  # noqa: PLC0415

    rng = random.Random(seed)
    if seed % 3 == 0:  # a large pool: slices wider than one block, many chains
        m = rng.choice([5000, 70000])
        slots = rng.sample(range(m), m // 2)
        cuts = sorted(rng.sample(range(1, len(slots)), 300))
        chains = [slots[a:b] for a, b in zip([0, *cuts], [*cuts, len(slots)], strict=True)]
        e = TR.export_of(chains, m, [rng.randint(0, 9000) for _ in chains],
                         [rng.choice([-1, rng.randrange(m)]) for _ in chains],
                         [rng.randint(0, 1) for _ in chains] if seed % 2 else None)
        cursor, width = rng.randrange(m), rng.choice([512, 1500])
    else:
        e, m, cursor, width = TR._random_export(rng)
    want = TR.oracle_roll(e, m, cursor, width)
    outs = {b: _roll_outputs(e, m, cursor, width, b, d) for b, d in (("cuda", CUDA), ("cpu", "cpu"), ("torch", CUDA))}
    for other in ("cpu", "torch"):
        for a, b in zip(outs["cuda"], outs[other], strict=True):
            assert torch.equal(a, b), other
    assert [x.tolist() for x in outs["cuda"]] == [want[0], want[1], want[2]]


def _derive_case(rng: random.Random) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """slots (ids in and outside [0, m), repeats), lens (negative, huge: running sums that wrap), a stale inv."""
    m = rng.choice([7, 3000, 70000])
    big = 2**63 - 1
    slots = torch.randint(-3, m + 3, (rng.choice([0, 5, 2000, 100000]),))
    lens = torch.randint(-4, 10, (rng.choice([0, 1, 511, 513, 5000, 70000]),))
    if lens.numel() and rng.random() < 0.5:
        lens[torch.randint(0, lens.numel(), (3,))] = big
    return slots, lens, torch.randint(-2, 50, (m + rng.randint(0, 2),)), m


def _derive_on(dev: str, backend: str, slots: torch.Tensor, lens: torch.Tensor, inv: torch.Tensor,
               m: int) -> tuple[torch.Tensor, torch.Tensor]:
    iv, ends = inv.to(dev), torch.full_like(lens, -9, device=dev)
    derive_roll(slots.to(dev), lens.to(dev), iv, ends, m, backend=backend)
    return iv.cpu(), ends.cpu()


def _assert_derived(got: tuple[torch.Tensor, torch.Tensor], cpu: tuple[torch.Tensor, torch.Tensor],
                    slots: torch.Tensor) -> None:
    """ends exactly the CPU op's; inv too, except that a repeated id may name another of its indices."""
    assert torch.equal(got[1], cpu[1])
    differ = (got[0] != cpu[0]).nonzero().flatten()
    k = got[0][differ]
    assert bool(((k >= 0) & (k < slots.numel())).all()) and torch.equal(slots[k], differ)


@pytest.mark.parametrize("seed", range(16))
def test_derive_roll_matches(seed: int) -> None:
    slots, lens, inv, m = _derive_case(random.Random(seed))
    cpu = _derive_on("cpu", "cpu", slots, lens, inv, m)
    for backend in ("cuda", "torch"):
        _assert_derived(_derive_on(CUDA, backend, slots, lens, inv, m), cpu, slots)


def test_derive_roll_graph_replay() -> None:
    """derive_roll captured once, replayed on other contents of the same shapes: as the CPU op on those."""
    rng = random.Random(9)
    slots, lens, inv, m = _derive_case(rng)
    while slots.numel() == 0 or lens.numel() == 0:
        slots, lens, inv, m = _derive_case(rng)
    t = [x.to(CUDA) for x in (slots, lens, inv)]
    ends = torch.zeros_like(t[1])
    derive_roll(*t, ends, m, backend="cuda")  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        derive_roll(*t, ends, m, backend="cuda")
    slots2 = torch.randint(-3, m + 3, slots.shape)
    lens2 = torch.randint(-4, 10, lens.shape)
    for dst, src in zip(t, (slots2, lens2, inv), strict=True):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    _assert_derived((t[2].cpu(), ends.cpu()), _derive_on("cpu", "cpu", slots2, lens2, inv, m), slots2)


def test_plan_roll_graph_replay() -> None:
    """plan_roll captured once, replayed with another cursor's inverse contents: equals an eager run."""
    import test_plan_roll as TR  # noqa: PLC0415

    rng = random.Random(5)
    m, width = 4000, 512
    slots = rng.sample(range(m), 3000)
    e = TR.export_of([slots[:1000], slots[1000:]], m, [0, 7], [-1, 3])
    t = {k: torch.tensor(getattr(e, k), dtype=torch.int64, device=CUDA) for k in
         ("slots", "starts", "lens", "ends", "firsts", "prevs", "inv")}
    plan = torch.zeros(width, NUM_PLAN_COLS, dtype=torch.int64, device=CUDA)
    status = torch.zeros(NUM_PLAN_STATUS_COLS, dtype=torch.int64, device=CUDA)
    chain_out = torch.zeros(width, dtype=torch.int64, device=CUDA)
    args = (plan, status, chain_out, t["slots"], t["starts"], t["lens"], t["ends"], t["firsts"], t["prevs"],
            t["inv"], m, 100)
    plan_roll(*args, backend="cuda")  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan_roll(*args, backend="cuda")
    e2 = TR.export_of([slots[2000:], slots[:2000]], m, [3, 0], [5, -1])  # the same shapes, other contents
    for k in ("starts", "lens", "ends", "firsts", "prevs", "inv", "slots"):
        t[k].copy_(torch.tensor(getattr(e2, k), dtype=torch.int64))
    graph.replay()
    torch.cuda.synchronize()
    want = TR.oracle_roll(e2, m, 100, width)
    n = int(status[PlanStatusCol.NUM_SEGMENTS])
    assert [plan[:n].tolist(), status.tolist(), chain_out.tolist()] == [want[0], want[1], want[2]]


# ---- large batches: tiles, long segments, SWA windows, fingerprints ------------------------------------------------

LARGE = [
    {"bs": 1, "prefix": 0, "ext": 16384},
    {"bs": 1, "prefix": 3000, "ext": 5000, "pool": True, "expect": True},
    {"bs": 3, "prefix": [0, 1500, 2047], "ext": [2100, 1, 4099], "expect": True},
    {"bs": 64, "prefix": 300, "ext": 1, "pool": True},
    {"bs": 200, "prefix": [i * 7 % 333 for i in range(200)], "ext": [i % 3 for i in range(200)]},
    {"bs": 16, "prefix": 700, "ext": 1, "swa": True, "window": 128},
    {"bs": 4, "prefix": 1000, "ext": 700, "swa": True, "window": 100, "halves": 1},
    {"bs": 8, "prefix": 400, "ext": 300, "fp_mode": FingerprintMode.ALL, "fp_bytes": 2048},
    {"bs": 2, "prefix": 64, "ext": 1500, "fp_mode": FingerprintMode.ALL, "fp_bytes": 144, "contiguous": True},
    {"bs": 32, "prefix": 100, "ext": 1, "fp_mode": FingerprintMode.PARTIAL, "fp_bytes": 64},
    {"bs": 5, "prefix": 50, "ext": 20, "pad_tokens": 37, "contiguous": True, "corrupt": 0},
]


def _workspaces(max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    return write_workspace(max_tokens, CUDA), write_workspace(max_tokens, CUDA)


@pytest.mark.parametrize("look_back", [False, True])
@pytest.mark.parametrize("k", range(len(LARGE)))
def test_large_bracket_matches_reference(k: int, look_back: bool) -> None:
    b = make_batch(100 + k, **LARGE[k])  # type: ignore[arg-type]
    ref = run_bracket(b, "torch")
    got = run_bracket(b, "cuda", workspaces=_workspaces(int(b.ids.shape[0])) if look_back else None)
    assert_brackets_equal(got, ref, f"case {k}")


@pytest.mark.parametrize("k", range(len(LARGE)))
def test_verify_grid_hint_below_the_segments_matches_reference(k: int) -> None:
    """A grid sized for one entry per segment: the persistent verify loops over every entry of longer segments."""
    b = make_batch(100 + k, **LARGE[k])  # type: ignore[arg-type]
    assert_brackets_equal(run_bracket(b, "cuda", max_segment_entries=1), run_bracket(b, "torch"), f"case {k}")


# Long writes whose tiles must take their carry from earlier tiles: one long segment, segments crossing tiles with
# heads inside them, skipped tokens, seals of many small tiles; each run again on the same workspaces (generations).
LOOK_BACK = [
    {"bs": 1, "prefix": 0, "ext": 40000},
    {"bs": 1, "prefix": 77, "ext": 16385, "expect": True},
    {"bs": 9, "prefix": [i * 31 for i in range(9)], "ext": [1, 700, 3, 2000, 255, 257, 1, 5000, 129]},
    {"bs": 3, "prefix": [0, 10, 20], "ext": [3000, 4000, 100], "pad_tokens": 300, "contiguous": True, "corrupt": 0},
    {"bs": 2, "prefix": 5, "ext": 6000, "fp_mode": FingerprintMode.ALL, "fp_bytes": 144},
    {"bs": 4, "prefix": 900, "ext": 1500, "swa": True, "window": 100, "halves": 1},
]


@pytest.mark.parametrize("k", range(len(LOOK_BACK)))
def test_look_back_writes_match_reference_again_and_again(k: int) -> None:
    b = make_batch(700 + k, **LOOK_BACK[k])  # type: ignore[arg-type]
    ref = run_bracket(b, "torch")
    ws = _workspaces(int(b.ids.shape[0]) + 5)
    for rep in range(6):
        assert_brackets_equal(run_bracket(b, "cuda", workspaces=ws), ref, f"case {k} run {rep}")
        for w in ws:  # every launch leaves the ticket and done counters as it found them
            assert w[:2].tolist() == [0, 0], w[:4].tolist()
    assert all(int(w[2]) >= 6 for w in ws)  # ... and moved the generation (each write launched several blocks)


# ---- kept chain carries: the TAIL write takes the HEAD write's scan (docs/ops-contract.md 5) -------------------------

def _header(carries: torch.Tensor) -> dict[str, int]:
    return {c.name: int(carries[0, int(c)]) for c in CarryHeaderCol}


@pytest.mark.parametrize("k", range(len(LARGE) + len(LOOK_BACK)))
def test_kept_carries_match_reference_again_and_again(k: int) -> None:
    """Every large and look-back case with the HEAD write keeping its chain carries and the TAIL write taking them:
    the reference's outputs, run after run on the same carries, with and without look-back workspaces; each kept
    scan is used once (the TAIL write disarms it) unless the TAIL write scans itself (ALL fingerprints)."""
    case = (LARGE + LOOK_BACK)[k]
    b = make_batch(100 + k if k < len(LARGE) else 700 + k - len(LARGE), **case)  # type: ignore[arg-type]
    ref = run_bracket(b, "torch")
    n = int(b.ids.shape[0])
    ws, carries = _workspaces(n + 5), write_carries(n + 5, CUDA)
    for rep in range(3):
        got = run_bracket(b, "cuda", workspaces=None if rep == 1 else ws, carries=carries)
        assert_brackets_equal(got, ref, f"case {k} run {rep}")
        hd = _header(carries)
        assert hd["DONE"] == 0, hd
        if case.get("fp_mode") != FingerprintMode.ALL:
            assert hd["ARMED"] == 0, hd


def _tail_write(b: Any, plan: torch.Tensor, status: torch.Tensor, carries: torch.Tensor | None,
                ) -> tuple[torch.Tensor, Sink]:
    tail, sink = clone_group(b.tail), Sink.allocate(4096, CUDA)
    sink.step.fill_(5)  # run_bracket's step
    write(tail, Stage.TAIL, plan, status, b.table, b.ids, b.pos, b.loc, sink,
          checks=ALL_CHECKS | (int(WriteCheck.REUSE_CARRIES) if carries is not None else 0), token_pool=b.pool,
          carries=carries, backend="cuda")
    return tail.records, sink


def test_kept_carries_are_what_the_tail_write_applies() -> None:
    """The TAIL write applies the kept rows, not a scan of its own: a changed carry moves exactly that entry's chain
    value; a row naming no entry of the plan is not applied and counts one INPUT_ERRORS per half; a header of another
    step, or one already taken, makes it scan (the scan's outputs whatever the rows hold)."""
    b = make_batch(41, bs=3, prefix=[0, 100, 7], ext=[3000, 1500, 900], corrupt=0, halves=2)
    n = int(b.ids.shape[0])
    carries = write_carries(n, CUDA)
    got = run_bracket(b, "cuda", workspaces=_workspaces(n), carries=carries)
    assert _header(carries)["TOTAL"] == n and _header(carries)["ARMED"] == 0
    plan, status = got["plan"], got["status"]
    want, want_sink = _tail_write(b, plan, status, None)

    def slot_of(e: int) -> int:
        row = carries[1 + e]
        k = int(plan[int(row[int(CarryCol.SEGMENT)]), int(PlanCol.WRITE_BEGIN)]) + int(row[int(CarryCol.J)])
        return int(b.loc[k])

    moved, dropped = 1234, 4000
    moved_slot, dropped_slot = slot_of(moved), slot_of(dropped)
    carries[1 + moved, int(CarryCol.ADD)] += 1
    carries[1 + dropped, int(CarryCol.SEGMENT)] = -1
    carries[0, int(CarryHeaderCol.ARMED)] = 1
    rec, sink = _tail_write(b, plan, status, carries)
    differ = set((rec != want).any(dim=2).any(dim=1).nonzero().flatten().tolist())
    assert differ == {moved_slot, dropped_slot}
    assert torch.equal(rec[dropped_slot], b.tail.records[dropped_slot])  # not written
    chain, rest = int(RecordField.PREV_HASH), [int(RecordField.TOKEN), int(RecordField.POSITION)]
    assert (rec[moved_slot, :, chain] != want[moved_slot, :, chain]).all()  # only its chain value moved
    assert torch.equal(rec[moved_slot][:, rest], want[moved_slot][:, rest])
    for h in range(2):
        tag = int(b.tail.tags(Stage.TAIL)[h])
        d = (sink.counters[tag] - want_sink.counters[tag]).tolist()
        assert d[int(CounterCol.INPUT_ERRORS)] == 1 and d[int(CounterCol.ENTRIES_WRITTEN)] == -1, d
    assert _header(carries)["ARMED"] == 0
    # already taken, then another step's header: the scan
    for armed, step in ((0, 5), (1, 6)):
        carries[0, int(CarryHeaderCol.ARMED)], carries[0, int(CarryHeaderCol.STEP)] = armed, step
        rec, sink = _tail_write(b, plan, status, carries)
        assert torch.equal(rec, want) and torch.equal(sink.counters, want_sink.counters)


@pytest.mark.parametrize("fp_mode", [None, FingerprintMode.PARTIAL])
def test_v_only_damage_matches_reference(fp_mode: FingerprintMode | None) -> None:
    """K+V: V records that no longer mirror K (each field), a damaged V predecessor, a K failure beside a clean V, a
    V-only KV flip: the CUDA verify's V shortcut (V mirrors K) must give the reference's rows exactly."""
    b = make_batch(31, bs=24, prefix=300, ext=1, halves=2, corrupt=0, pool=True, expect=True, fp_mode=fp_mode,
                   fp_bytes=64)
    rng = random.Random(5)
    slots = b.table[:, :300].reshape(-1).tolist()
    for field in range(4):  # token, position, prev_hash, fingerprint of the V half
        for buf in (b.head, b.tail):
            buf.records[rng.choice(slots), 1, field] += 1 + field
    b.tail.records[rng.choice(slots), 0, 2] ^= 1  # K damaged, V clean: V takes the full check
    nxt = int(b.table[3, 11])  # V damaged in the predecessor only: slot 11's V link differs from K's
    b.tail.records[int(b.table[3, 10]), 1, 0] += 7
    if b.fp is not None:
        b.fp.sources.rows[1][0][nxt, 0] ^= 4  # V's KV bytes (the partial 16) of one slot
    ref = run_bracket(b, "torch")
    got = run_bracket(b, "cuda")
    assert_brackets_equal(got, ref, f"V-only damage, fp {fp_mode}")
    assert int(ref["sink"].count[0]) >= 9


def test_clean_large_bracket_reports_nothing() -> None:
    b = make_batch(7, bs=4, prefix=[0, 5000, 17, 1024], ext=[3000, 1, 2000, 9000], corrupt=0, expect=True, pool=True,
                   fp_mode=FingerprintMode.ALL, fp_bytes=512)
    got = run_bracket(b, "cuda")
    assert int(got["sink"].count[0]) == 0, got["sink"].rows[:4]
    # The TAIL write's records verify clean in the next forward's TAIL verify (chain continuity across tiles).
    sink = Sink.allocate(64, CUDA)
    plan = torch.zeros(4, NUM_PLAN_COLS, dtype=torch.int64, device=CUDA)
    status = torch.zeros(NUM_PLAN_STATUS_COLS, dtype=torch.int64, device=CUDA)
    plan_forward(plan, status, b.rpi, b.pre + b.ext, torch.zeros_like(b.ext), b.table, 0, backend="cuda")
    tail = GroupView(got["tail"], b.tail.group, b.tail.reserved_slots, b.tail.swa_map)
    verify(tail, Stage.TAIL, plan, status, b.table, sink, fingerprint=b.fp, backend="cuda")
    assert int(sink.count[0]) == 0
    assert int(status[PlanStatusCol.VERIFY_ENTRIES]) == int((b.pre + b.ext).sum())


# ---- CUDA graphs: capture a whole bracket, replay with other contents ---------------------------------------------

@pytest.mark.parametrize("kept", [False, True])
def test_graph_capture_and_replay_with_changed_batches(kept: bool) -> None:
    """A captured bracket replayed on new batch contents equals the reference; ``kept``: PARTIAL fingerprints and the
    TAIL write taking the HEAD write's kept carries inside the graph (each replay keeps and takes its own)."""
    bs, width, T = 6, 900, 1200
    num_slots = bs * width + 1
    srcs = [[SourceSpec(torch.randint(0, 256, (num_slots, 256), dtype=torch.uint8, device=CUDA))] for _ in range(2)]
    fp = Fingerprint(FingerprintSources(srcs, num_slots), FingerprintMode.PARTIAL if kept else FingerprintMode.ALL)
    carries = write_carries(T, CUDA) if kept else None
    keep, take = (int(WriteCheck.RECORD_CARRIES), int(WriteCheck.REUSE_CARRIES)) if kept else (0, 0)
    table = torch.zeros(bs, width, dtype=torch.int64, device=CUDA)
    head = GroupView(torch.zeros(num_slots, 2, 4, dtype=torch.int64, device=CUDA), reserved_slots=1)
    tail = GroupView(torch.zeros(num_slots, 2, 4, dtype=torch.int64, device=CUDA), reserved_slots=1)
    rpi, pre, ext = (torch.zeros(bs, dtype=torch.int64, device=CUDA) for _ in range(3))
    ids, pos, loc = (torch.zeros(T, dtype=torch.int64, device=CUDA) for _ in range(3))
    plan = torch.zeros(bs, NUM_PLAN_COLS, dtype=torch.int64, device=CUDA)
    status = torch.zeros(NUM_PLAN_STATUS_COLS, dtype=torch.int64, device=CUDA)
    sink = Sink.allocate(1024, CUDA)

    ws = _workspaces(T)  # replays reuse them: each launch restores them for the next (a new generation)

    def bracket(backend: str, h: GroupView, t: GroupView, s: Sink, p: torch.Tensor, st: torch.Tensor,
                tbl: torch.Tensor, r: torch.Tensor, pr: torch.Tensor, ex: torch.Tensor, i: torch.Tensor,
                q: torch.Tensor, lc: torch.Tensor) -> None:
        plan_forward(p, st, r, pr, ex, tbl, T, backend=backend)
        verify(h, Stage.HEAD, p, st, tbl, s, backend=backend)
        write(h, Stage.HEAD, p, st, tbl, i, q, lc, s, checks=ALL_CHECKS | keep, workspace=ws[0], carries=carries,
              backend=backend)
        verify(t, Stage.TAIL, p, st, tbl, s, fingerprint=fp, backend=backend)
        write(t, Stage.TAIL, p, st, tbl, i, q, lc, s, checks=ALL_CHECKS | take, fingerprint=fp, workspace=ws[1],
              carries=carries, backend=backend)

    args = (head, tail, sink, plan, status, table, rpi, pre, ext, ids, pos, loc)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        bracket("cuda", *args)  # warm-up (module load, occupancy queries) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bracket("cuda", *args)
    for seed in range(4):
        rng = random.Random(seed)
        pres = [rng.randrange(1, 700) for _ in range(bs)]
        exts = [rng.randrange(0, 190) for _ in range(bs)]
        b = make_batch(50 + seed, bs=bs, prefix=pres, ext=exts, halves=2, corrupt=seed, reserved=1,
                       contiguous=seed % 2 == 0)
        assert b.head.num_slots <= num_slots and b.table.shape[1] <= width
        for h in range(2):  # same fingerprint sources: new random KV bytes in place
            srcs[h][0].tensor.copy_(torch.randint(0, 256, (num_slots, 256), dtype=torch.uint8, device=CUDA))
        # Load this batch into the static tensors (same shapes, new values).
        head.records.zero_()
        tail.records.zero_()
        head.records[:b.head.num_slots] = b.head.records
        tail.records[:b.tail.num_slots] = b.tail.records
        every = torch.arange(num_slots, device=CUDA)
        for h in range(2):  # TAIL prefix records carry the fingerprints of this batch's KV bytes
            tail.records[:, h, 3] = fingerprint(fp.sources, h, every, tail.records[:, h, 1].clamp(min=0),
                                                fp.mode, backend="torch")
        table.fill_(-1)
        table[:, :b.table.shape[1]] = b.table
        rpi.copy_(b.rpi)
        pre.copy_(b.pre)
        ext.copy_(b.ext)
        n = b.ids.shape[0]
        ids.zero_()
        pos.zero_()
        loc.fill_(-1)
        ids[:n], pos[:n], loc[:n] = b.ids, b.pos, b.loc
        if seed:  # one corrupted prefix record that HEAD verify must report inside the replay
            head.records[int(table[0, pres[0] // 2]), 1, 2] ^= 1
        for tnsr in (sink.rows, sink.count, sink.counters):
            tnsr.zero_()
        sink.step.fill_(seed)
        ref_args = (GroupView(head.records.clone(), reserved_slots=1),
                    GroupView(tail.records.clone(), reserved_slots=1),
                    Sink.allocate(1024, CUDA), plan.clone(), status.clone(), table, rpi, pre, ext, ids, pos, loc)
        ref_args[2].step.fill_(seed)
        bracket("torch", *ref_args)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(status, ref_args[4]), seed
        assert torch.equal(head.records, ref_args[0].records), seed
        assert torch.equal(tail.records, ref_args[1].records), seed
        assert_sinks_equal(sink, ref_args[2], f"replay {seed}")
        if seed:
            assert int(sink.count[0]) > 0  # the corruptions were found inside the replay
        if carries is not None:  # this replay's scan was kept and taken
            hd = _header(carries)
            assert [hd["TOTAL"], hd["STEP"], hd["ARMED"], hd["DONE"]] == [n, seed, 0, 0], hd


# ---- fingerprint and scatter_tokens ops ---------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(30))
def test_fingerprint_op_matches(seed: int) -> None:
    rng = random.Random(seed)
    num_slots = rng.randint(1, 3000)
    halves, n_src = rng.choice([1, 2]), rng.randint(1, 4)
    specs = []
    for _ in range(halves):
        hs = []
        for _ in range(n_src):
            page = rng.choice([1, 1, 4, 16])
            bpt = 16 * rng.randint(1, 160)
            rows = -(-num_slots // page)
            t = torch.randint(0, 256, (rows, page * bpt + 16 * rng.randint(0, 2)), dtype=torch.uint8)
            if rng.random() < 0.5:
                t = t.view(torch.bfloat16)
            hs.append(SourceSpec(t, page_size=page, bytes_per_token=bpt,
                                 read_bytes=rng.choice([None, 0, 16, 16 * rng.randint(1, bpt // 16)])))
        specs.append(hs)
    cpu_src = FingerprintSources(specs, num_slots)
    gpu_src = sources_to(cpu_src, CUDA)
    n = rng.randint(0, 5000)
    slots = torch.randint(-3, num_slots + 3, (n,))
    positions = torch.randint(-2, 5000, (n,))
    positions[::97] = TOKEN_LIMIT
    for mode in (FingerprintMode.PARTIAL, FingerprintMode.ALL):
        stride = rng.choice([1, 2, 3])
        half = rng.randrange(halves)
        want = fingerprint(cpu_src, half, slots, positions, mode, stride, backend="cpu")
        got = fingerprint(gpu_src, half, slots.to(CUDA), positions.to(CUDA), mode, stride, backend="cuda")
        ref = fingerprint(gpu_src, half, slots.to(CUDA), positions.to(CUDA), mode, stride, backend="torch")
        assert torch.equal(got.cpu(), want), (seed, mode)
        assert torch.equal(got, ref), (seed, mode)


@pytest.mark.parametrize("seed", range(20))
def test_scatter_tokens_matches(seed: int) -> None:
    rng = random.Random(seed)
    R, L = rng.randint(1, 300), rng.randint(1, 5000)
    n = rng.randint(0, R)
    rows = torch.tensor(rng.sample(range(R), n), dtype=torch.int64)  # distinct rows (duplicates: undefined order)
    if n and rng.random() < 0.5:
        rows[rng.randrange(n)] = rng.choice([-1, R])
    starts = torch.randint(-1, L, (n,))
    counts = torch.randint(-1, 600, (n,))
    T = int(counts.clamp(min=0).sum()) - rng.choice([0, 0, 50])
    tokens = torch.randint(0, 100_000, (max(T, 0),))
    outs = {}
    for backend, dev in (("cpu", "cpu"), ("cuda", CUDA), ("torch", CUDA)):
        pool = TokenPool(torch.full((R, L), -5, dtype=torch.int64, device=dev), torch.zeros(R, dtype=torch.int64,
                                                                                          device=dev))
        status = torch.full((1,), 3, dtype=torch.int64, device=dev)
        scatter_tokens(pool, rows.to(dev), starts.to(dev), counts.to(dev), tokens.to(dev), status, backend=backend)
        outs[backend] = (pool.tokens.cpu(), pool.lens.cpu(), status.cpu())
    for other in ("cpu", "torch"):
        for a, b in zip(outs["cuda"], outs[other], strict=True):
            assert torch.equal(a, b), other


def test_native_entries_refuse_cpu_tensors() -> None:
    from kvcanary import _native  # noqa: PLC0415

    mod = _native.module("cuda")
    z = torch.zeros(4, NUM_PLAN_COLS, dtype=torch.int64)
    s = torch.zeros(NUM_PLAN_STATUS_COLS, dtype=torch.int64)
    e = torch.zeros(0, dtype=torch.int64)
    one = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError):
        mod.plan_forward(z, s, one, one, one, torch.zeros(1, 1, dtype=torch.int64), e, 0, e, 0, e, 0, 1, 0, -1, 1, e, e,
                         e, 0, e)
    with pytest.raises(ValueError):
        mod.fingerprint(torch.zeros(1, 1, 5, dtype=torch.int64), 0, one, one, 2, 1, 1, one)


@pytest.mark.parametrize(("k", "n"), [(0, 0), (2, 0), (0, 9), (1, 200), (2, 3)])
def test_bookkeep_matches(k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(k + n)
    counter, acc = torch.randint(-5, 5, (k,), generator=gen), torch.randint(-99, 99, (n,), generator=gen)
    src = torch.randint(-99, 99, (n,), generator=gen)
    outs = []
    for backend, dev in (("torch", CUDA), ("cuda", CUDA), ("cpu", "cpu")):
        c, a = counter.to(dev), acc.to(dev)
        bind_bookkeep(c, a, src.to(dev), backend).frozen()(torch.zeros(1, 1, dtype=torch.int64, device=dev))
        outs.append((c.cpu(), a.cpu()))
    for c, a in outs[1:]:
        assert torch.equal(c, outs[0][0]) and torch.equal(a, outs[0][1])


@pytest.mark.parametrize("backend", ["cuda", "torch"])
def test_bookkeep_mirror_replays_in_a_graph(backend: str) -> None:
    """The mirror in pinned host memory, written by a captured bookkeep on every replay: the tag is the counter after
    the replay and the values are the device values of that replay (read after a sync, no copy)."""
    counter, values = torch.tensor([5], device=CUDA), torch.tensor([0, 0], device=CUDA)
    mirror = torch.full((3,), -1, dtype=torch.int64, pin_memory=True)
    # not frozen: its torch tensor arguments give tvm-ffi the capture stream (a frozen op alone would launch on the
    # default stream; in the runtime it runs inside a sequence that takes the slot table)
    op = bind_bookkeep(counter, counter[:0], counter[:0], backend, values, mirror)
    table = torch.zeros(1, 1, dtype=torch.int64, device=CUDA)
    side, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        op(table)
    torch.cuda.current_stream().wait_stream(side)
    for r in range(1, 4):
        values.copy_(torch.tensor([r, 10 * r]))
        graph.replay()
        torch.cuda.synchronize()
        assert mirror.tolist() == [5 + r, r, 10 * r]


def test_bookkeep_mirror_must_be_pinned() -> None:
    counter, values = torch.zeros(1, dtype=torch.int64, device=CUDA), torch.zeros(1, dtype=torch.int64, device=CUDA)
    for backend in ("cuda", "torch"):
        with pytest.raises(CanaryInputError, match="pinned"):
            bind_bookkeep(counter, counter[:0], counter[:0], backend, values, torch.zeros(2, dtype=torch.int64))
    from kvcanary import _native  # noqa: PLC0415

    mod = _native.module("cuda")  # the native entry checks it too (the binder is not the only caller)
    with pytest.raises(ValueError, match="pinned"):
        mod.bookkeep(counter, counter[:0], counter[:0], values, torch.zeros(2, dtype=torch.int64))
    assert int(counter[0]) == 0


# ---- invalidate --------------------------------------------------------------------------------------------------

def _records(b: int, s: int, h: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-2**40, 2**40, (b, s, h, RECORD_NUM_FIELDS), generator=gen, dtype=torch.int64)


@pytest.mark.parametrize("where", ["device", "host"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize(("b", "s", "h", "n"), [(2, 1, 1, 0), (2, 37, 2, 50), (3, 9, 1, INVALIDATE_INLINE_SLOTS),
                                                (1, 3000, 1, 2 * INVALIDATE_INLINE_SLOTS + 17), (2, 5000, 2, 4000)])
def test_invalidate_matches(where: str, dtype: torch.dtype, b: int, s: int, h: int, n: int) -> None:
    """Device ids, and host ids over several launches' parameters (most ids kept: three chunks at n = 1937), against
    the CPU reference and the CPU op; the torch reference on the device too."""
    base = _records(b, s, h, seed=s + n)
    slots = torch.randint(-3, s + 3, (n,), generator=torch.Generator().manual_seed(n)).to(dtype)
    reserved = min(2, s)
    want, cpu = base.clone(), base.clone()
    invalidate(want, slots, reserved, "torch")
    invalidate(cpu, slots, reserved, "cpu")
    assert torch.equal(cpu, want)
    for backend in ("cuda", "torch"):
        rec = base.to(CUDA)
        invalidate(rec, slots.to(CUDA) if where == "device" else slots, reserved, backend)
        assert torch.equal(rec.cpu(), want), backend


@pytest.mark.parametrize("where", ["device", "host"])
def test_invalidate_replays_in_a_graph(where: str) -> None:
    """Captured: device ids are read at each replay; host ids are fixed at capture (they travel in the launch's
    parameters), so the list may change after the call."""
    base = _records(2, 64, 2, seed=7).to(CUDA)
    rec = base.clone()
    host = torch.tensor([5, 9, 0, 70], dtype=torch.int32)
    slots = host.to(CUDA) if where == "device" else host
    op = bind_invalidate(rec, 1, "cuda")
    side, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        op(slots)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(rec, base)  # a capture runs nothing
    for new in ([11, 12, 1, -4], [63, 64, 3, 3]):
        slots.copy_(torch.tensor(new, dtype=torch.int32))
        rec.copy_(base)
        graph.replay()
        torch.cuda.synchronize()
        want = base.cpu()
        invalidate(want, torch.tensor(new if where == "device" else [5, 9, 0, 70]), 1, "torch")
        assert torch.equal(rec.cpu(), want)


def test_invalidate_bad_input_raises_before_any_launch() -> None:
    rec = _records(2, 8, 1, seed=1).to(CUDA)
    was = rec.clone()
    with pytest.raises(CanaryInputError, match="slots"):
        invalidate(rec, torch.tensor([1.0], device=CUDA), 0, "cuda")
    with pytest.raises(CanaryInputError, match="slots"):
        invalidate(rec.cpu(), torch.tensor([1], device=CUDA), 0, "cpu")
    from kvcanary import _native  # noqa: PLC0415

    mod = _native.module("cuda")  # the native entry checks them again
    for records, slots, reserved in ((rec, torch.tensor([1.0]), 0), (rec, torch.tensor([1]), 9),
                                     (rec, torch.tensor([[1]], device=CUDA), 0), (rec.cpu(), torch.tensor([1]), 0),
                                     (rec[..., :2], torch.tensor([1]), 0)):
        with pytest.raises((TypeError, ValueError)):
            mod.invalidate(records, slots, reserved)
    torch.cuda.synchronize()
    assert torch.equal(rec, was)


# ---- slot_rows ---------------------------------------------------------------------------------------------------

def _slot_rows_on(case: dict[str, Any], device: str, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    c = {k: v.clone().to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    slot_rows(**c, backend=backend)
    return c["table"].cpu(), c["out"].cpu()


@pytest.mark.parametrize("seed", range(40))
def test_slot_rows_matches(seed: int) -> None:
    """The CUDA op against the CPU op and the torch reference (rows named by several requests included); large cases
    stride the grid over many rows."""
    import test_slot_rows as TS  # noqa: PLC0415

    case = TS._case(random.Random(seed))
    if seed % 10 == 9:  # many requests of long segments (a grid smaller than its jobs)
        bs, L = 3000, 700
        lens = torch.randint(0, 900, (bs,), generator=torch.Generator().manual_seed(seed))
        rows = torch.randperm(bs) if seed % 20 == 9 else torch.randint(0, 40, (bs,))  # or rows named many times
        case = {"table": torch.zeros(bs, L, dtype=torch.int32), "rows": rows, "lens": lens,
                "starts": torch.cumsum(lens, 0) - lens, "src": torch.randint(-3, 10**6, (int(lens.sum()),)),
                "out": torch.zeros(5000, dtype=torch.int64), "write": torch.randint(-3, 10**6, (5000,)),
                "stride": 7, "page": 4}
    want = _slot_rows_on(case, "cpu", "cpu")
    for backend in ("cuda", "torch"):
        got = _slot_rows_on(case, CUDA, backend)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (seed, backend)


def test_slot_rows_replays_in_a_graph() -> None:
    """Captured once; each replay reads the row facts and slots the buffers hold then."""
    def case(seed: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(seed)
        lens = torch.randint(-1, 7, (3,), generator=g)
        return {"table": torch.randint(-5, 9, (4, 6), generator=g), "rows": torch.randint(-1, 5, (3,), generator=g),
                "starts": torch.randint(-1, 6, (3,), generator=g), "lens": lens,
                "src": torch.randint(-3, 99, (11,), generator=g, dtype=torch.int32),
                "out": torch.zeros(6, dtype=torch.int64), "write": torch.randint(-3, 99, (6,), generator=g),
                "stride": 6, "page": 4}
    buf = {k: v.to(CUDA) if isinstance(v, torch.Tensor) else v for k, v in case(0).items()}
    side, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        slot_rows(**buf, backend="cuda")
    torch.cuda.current_stream().wait_stream(side)
    for seed in range(1, 6):
        now = case(seed)
        for k, v in now.items():
            if isinstance(v, torch.Tensor):
                buf[k].copy_(v)
        graph.replay()
        torch.cuda.synchronize()
        want = _slot_rows_on(now, "cpu", "cpu")
        assert torch.equal(buf["table"].cpu(), want[0]) and torch.equal(buf["out"].cpu(), want[1]), seed


def test_slot_rows_bad_input_raises_before_any_launch() -> None:
    from kvcanary import _native  # noqa: PLC0415

    mod = _native.module("cuda")
    table, out = torch.zeros(2, 3, dtype=torch.int64, device=CUDA), torch.zeros(2, dtype=torch.int64, device=CUDA)
    one = torch.zeros(1, dtype=torch.int64, device=CUDA)
    src, write = torch.zeros(2, dtype=torch.int64, device=CUDA), torch.zeros(2, dtype=torch.int64, device=CUDA)
    for args in ((table, one.cpu(), one, one, src, out, write, 4, 2), (table, one, one, one, src, out, write[:1], 4, 2),
                 (table, one, one, one, src, out, write, 2, 4), (table.cpu(), one, one, one, src, out, write, 4, 2),
                 (table, one, one, one, src.float(), out, write, 4, 2)):
        with pytest.raises((TypeError, ValueError)):
            mod.slot_rows(*args)
    torch.cuda.synchronize()
    assert not table.any() and not out.any()


def _stage_rows_on(case: dict[str, Any], device: str, backend: str) -> tuple[torch.Tensor, ...]:
    """(table, out, staging, facts) after one stage_slot_rows of ``case`` (test_slot_rows._stage_case) on ``device``
    (staging pinned for CUDA; the facts are then their own device buffer)."""
    c = {k: v.clone().to(device) if isinstance(v, torch.Tensor) and k != "staging" else v for k, v in case.items()}
    c["staging"] = case["staging"].clone().pin_memory() if device != "cpu" else case["staging"].clone()
    c["facts"] = case["facts"].clone().to(device)
    stage_slot_rows(**c, backend=backend)
    return tuple(c[k].cpu() for k in ("table", "out", "staging", "facts"))


@pytest.mark.parametrize("seed", range(40))
def test_stage_slot_rows_matches(seed: int) -> None:
    """The CUDA op (the facts copied from pinned staging, then the fill) against the CPU op, and the torch backend on
    CUDA; every tenth case a large batch (the fill's grid smaller than its jobs)."""
    import test_slot_rows as TS  # noqa: PLC0415

    case = TS._stage_case(random.Random(seed))
    if seed % 10 == 9:
        bs, L = 3000, 700
        g = torch.Generator().manual_seed(seed)
        kv = torch.randint(0, 900, (bs,), generator=g)
        pre = torch.randint(0, 500, (bs,), generator=g)
        rows = torch.randperm(bs) if seed % 20 == 9 else torch.randint(0, 40, (bs,), generator=g)
        case = {"table": torch.zeros(bs, L, dtype=torch.int32), "facts_in": torch.stack([rows, pre, kv - pre]).numpy(),
                "staging": torch.zeros(5, bs + 7, dtype=torch.int64),
                "facts": torch.zeros(5, bs + 7, dtype=torch.int64),
                "src": torch.randint(-3, 10**6, (int(kv.sum()),), generator=g),
                "out": torch.zeros(5000, dtype=torch.int64), "write": torch.randint(-3, 10**6, (5000,), generator=g),
                "stride": 7, "page": 4}
    _check_stage_rows(case, seed)


def _check_stage_rows(case: dict[str, Any], what: object) -> None:
    """The CUDA op and the torch backend on CUDA against the CPU op. A CUDA batch of at most STAGE_INLINE_ROWS requests
    passes its facts in the launch: the staging stays as it was."""
    want = _stage_rows_on(case, "cpu", "cpu")
    inline = case["facts_in"].shape[1] <= STAGE_INLINE_ROWS
    for backend in ("cuda", "torch"):
        got = _stage_rows_on(case, CUDA, backend)
        expect = (*want[:2], case["staging"], want[3]) if backend == "cuda" and inline else want
        assert all(torch.equal(a, b) for a, b in zip(got, expect, strict=True)), (what, backend)


@pytest.mark.parametrize("bs", [0, 1, STAGE_INLINE_ROWS - 1, STAGE_INLINE_ROWS, STAGE_INLINE_ROWS + 1])
def test_stage_slot_rows_at_the_inline_bound(bs: int) -> None:
    """Batches on both sides of STAGE_INLINE_ROWS (facts in the launch, or copied from the staging), a row named
    twice, rows outside the table, staging wider than the batch: the CUDA op equals the CPU op."""
    g = torch.Generator().manual_seed(bs)
    rows = torch.randint(-1, 40, (bs,), generator=g)
    pre, ext = torch.randint(0, 30, (bs,), generator=g), torch.randint(0, 5, (bs,), generator=g)
    m = int((pre + ext).sum())
    case = {"table": torch.full((36, 40), -7, dtype=torch.int32), "facts_in": torch.stack([rows, pre, ext]).numpy(),
            "staging": torch.full((5, bs + 3), -5, dtype=torch.int64), "facts": torch.full((5, bs + 3), -6,
                                                                                         dtype=torch.int64),
            "src": torch.randint(-3, 10**5, (m,), generator=g), "out": torch.zeros(9, dtype=torch.int64),
            "write": torch.randint(-3, 10**5, (9,), generator=g), "stride": 7, "page": 4}
    _check_stage_rows(case, bs)


def test_stage_slot_rows_replays_in_a_graph() -> None:
    """Captured once (no event: a capture may not wait on one); each replay copies what the pinned staging holds then
    and fills from it, as slot_rows of those facts."""
    def facts(seed: int) -> np.ndarray:
        g = torch.Generator().manual_seed(seed)
        return torch.stack([torch.randint(-1, 5, (3,), generator=g), torch.randint(-1, 5, (3,), generator=g),
                            torch.randint(-2, 4, (3,), generator=g)]).numpy()
    table = torch.randint(-5, 9, (4, 6), device=CUDA)
    src = torch.randint(-3, 99, (11,), device=CUDA, dtype=torch.int32)
    out, write = torch.zeros(6, dtype=torch.int64, device=CUDA), torch.randint(-3, 99, (6,), device=CUDA)
    staging = torch.zeros(5, 4, dtype=torch.int64).pin_memory()
    dev_facts = torch.zeros(5, 4, dtype=torch.int64, device=CUDA)
    side, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        stage_slot_rows(table, facts(0), staging, dev_facts, src, out, write, 6, 4, backend="cuda")
    torch.cuda.current_stream().wait_stream(side)
    for seed in range(1, 6):
        f = facts(seed)
        host = torch.zeros(5, 4, dtype=torch.int64)
        stage_slot_rows(torch.zeros(1, 1, dtype=torch.int64), f, host, host, src[:0].cpu(),
                        out[:0].cpu(), write[:0].cpu(), 6, 4)  # the facts as the op stages them
        staging.copy_(host)
        before = table.cpu()
        graph.replay()
        torch.cuda.synchronize()
        rows, pre, ext = f.tolist()
        kv = [p + e for p, e in zip(pre, ext, strict=True)]
        want_t, want_o = before.clone(), torch.zeros(6, dtype=torch.int64)
        slot_rows(want_t, torch.tensor(rows), torch.tensor(host[4, :3].tolist()), torch.tensor(kv), src.cpu(), want_o,
                  write.cpu(), 6, 4)
        assert torch.equal(table.cpu(), want_t) and torch.equal(out.cpu(), want_o), seed
        assert torch.equal(dev_facts[:, :3].cpu(), host[:, :3]), seed


@pytest.mark.parametrize("bs", [2, STAGE_INLINE_ROWS + 2])
def test_stager_waits_for_the_pending_copy(bs: int) -> None:
    """Stager calls queued behind a long kernel, each one's device facts read on the stream before the next call: a
    staged batch's host write must wait for the last call's copy (the event), a batch whose facts travel in the launch
    writes no staging; either way each read sees its own call's facts and the table ends with the last call's rows."""
    table = torch.zeros(2 * bs, 8, dtype=torch.int64, device=CUDA)
    stager = SlotRowStager(table, 4, 4, 2 * bs, "cuda")
    src, none = torch.arange(8 * bs, device=CUDA), torch.zeros(0, dtype=torch.int64, device=CUDA)
    facts = [np.array([list(range(k, 2 * bs, 2)), [k] * bs, [1 + k] * bs], dtype=np.int64) for k in (0, 1, 0)]
    torch.cuda._sleep(50_000_000)  # type: ignore[no-untyped-call]  # the calls below wait behind it
    seen = [[v.clone() for v in stager(f, src, none, none)] for f in facts]
    for f, got in zip(facts, seen, strict=True):
        assert [v.tolist() for v in got] == f.tolist()
    want = torch.zeros_like(table)
    for f in facts:
        slot_rows(want, *(torch.tensor(r, device=CUDA) for r in
                          (f[0], np.cumsum(f[1] + f[2]) - (f[1] + f[2]), f[1] + f[2])), src, none, none, 4, 4)
    assert torch.equal(table, want)


def test_stage_slot_rows_bad_input_raises_before_any_launch() -> None:
    """Pageable staging for a batch that is copied from it (more than STAGE_INLINE_ROWS requests: a copy the host would
    wait for), facts off the device, staging on it, int32 facts and narrow facts are input errors on CUDA, as the CPU
    module's checks; nothing is written. A batch whose facts travel in the launch needs no pinned staging."""
    bs = STAGE_INLINE_ROWS + 1
    table, out = torch.zeros(2, 3, dtype=torch.int64, device=CUDA), torch.zeros(2, dtype=torch.int64, device=CUDA)
    src, write = torch.zeros(2 * bs, dtype=torch.int64, device=CUDA), torch.zeros(2, dtype=torch.int64, device=CUDA)
    facts_in = np.array([[0] * bs, [0] * bs, [2] * bs], dtype=np.int64)
    pinned = torch.zeros(5, bs, dtype=torch.int64).pin_memory()
    dev_facts = torch.zeros(5, bs, dtype=torch.int64, device=CUDA)
    for args in ((table, facts_in, torch.zeros(5, bs, dtype=torch.int64), dev_facts),
                 (table, facts_in, pinned, dev_facts.cpu()), (table, facts_in, pinned.to(CUDA), dev_facts),
                 (table, facts_in.astype(np.int32), pinned, dev_facts), (table, facts_in, pinned, dev_facts[:, :1])):
        with pytest.raises(CanaryInputError):
            stage_slot_rows(*args, src, out, write, 4, 2, backend="cuda")
    torch.cuda.synchronize()
    assert not table.any() and not out.any() and not dev_facts.any() and not pinned.any()
    pageable, one = torch.zeros(5, 1, dtype=torch.int64), torch.zeros(5, 1, dtype=torch.int64, device=CUDA)
    src[:2] = torch.tensor([4, 5])
    stage_slot_rows(table, facts_in[:, :1].copy(), pageable, one, src, out, write, 4, 2, backend="cuda")
    assert table[0].tolist() == [2, 3, 0] and one[:, 0].tolist() == [0, 0, 2, 2, 0] and not pageable.any()


# ---- stage_window ------------------------------------------------------------------------------------------------

def _window_on(arena: torch.Tensor, views: dict[str, torch.Tensor], device: str, backend: str,
               tag: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dst, the arena after) of one stage_window on a copy of ``arena`` on ``device`` (dst pinned, -7 everywhere)."""
    a = arena.clone().to(device)
    v = {k: a[t.storage_offset():t.storage_offset() + t.numel()].view(t.shape) for k, t in views.items()}
    dst = torch.full((1 + arena.numel(),), -7, dtype=torch.int64).pin_memory()
    stage_window(v["head"], v["count"], v["rows"], v["reset"], dst, tag, backend=backend)
    torch.cuda.synchronize()
    return dst, a.cpu()


@pytest.mark.parametrize("seed", range(30))
def test_stage_window_matches(seed: int) -> None:
    """The CUDA op against the CPU op and the torch reference on the canary's arena layout (count and reset inside
    the head); large cases stride the block over thousands of rows."""
    import test_stage_window as TW  # noqa: PLC0415

    arena, views, n = TW.arena_case(random.Random(seed))
    if seed % 10 == 9:  # a ring of 3000 rows of 8, most kept
        h, cap, c = 40, 3000, 8
        arena = torch.randint(-(1 << 62), 1 << 62, (h + cap * c,))
        arena[5] = 2900 if seed < 20 else 5000
        views = {"head": arena[:h], "count": arena[5:6], "rows": arena[h:].view(cap, c), "reset": arena[5:30]}
        n = 1 + h + min(int(arena[5]), cap) * c
    want, arena_want = _window_on(arena, views, "cpu", "cpu", seed + 3)
    for backend in ("cuda", "torch"):
        got, arena_got = _window_on(arena, views, CUDA, backend, seed + 3)
        assert torch.equal(got[:n], want[:n]) and torch.equal(arena_got, arena_want), (seed, backend)
    got, _ = _window_on(arena, views, CUDA, "cuda", seed + 3)
    assert bool((got[n:] == -7).all())  # the native op writes no row past the kept ones


def test_stage_window_replays_in_a_graph() -> None:
    """Captured once; each replay stages what the arena holds then (the tag is the captured one)."""
    arena = torch.zeros(4 + 5 * 2, dtype=torch.int64, device=CUDA)
    views = (arena[:4], arena[1:2], arena[4:].view(5, 2), arena[1:3])
    dst = torch.full((15,), -7, dtype=torch.int64).pin_memory()
    side, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        stage_window(*views, dst, 9, backend="cuda")
    torch.cuda.current_stream().wait_stream(side)
    for seed in range(1, 6):
        now = torch.randint(-99, 99, arena.shape, generator=torch.Generator().manual_seed(seed))
        now[1] = seed - 1
        arena.copy_(now)
        dst.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        want = [9, *now[:4].tolist(), *now[4:4 + 2 * (seed - 1)].tolist()]
        assert dst[:len(want)].tolist() == want and dst[len(want):].eq(-7).all(), seed
        assert arena[1:3].eq(0).all() and torch.equal(arena[3:].cpu(), now[3:]), seed


def test_stage_window_bad_input_raises_before_any_launch() -> None:
    from kvcanary import _native  # noqa: PLC0415

    mod = _native.module("cuda")
    arena = torch.arange(10, dtype=torch.int64, device=CUDA)
    head, count, rows, reset = arena[:4], arena[2:3], arena[4:].view(3, 2), arena[2:4]
    dst = torch.zeros(11, dtype=torch.int64).pin_memory()
    with pytest.raises(CanaryInputError, match="pinned"):
        stage_window(head, count, rows, reset, torch.zeros(11, dtype=torch.int64), 1, backend="cuda")
    for args in ((head, count, rows, reset, torch.zeros(11, dtype=torch.int64)),  # pageable
                 (head, count, rows, reset, dst[:10]), (head, arena[2:4], rows, reset, dst),
                 (head, count, rows.cpu(), reset, dst), (head, count, rows, reset, dst.to(CUDA))):
        with pytest.raises((TypeError, ValueError)):
            mod.stage_window(*args, 1)
    torch.cuda.synchronize()
    assert torch.equal(arena.cpu(), torch.arange(10)) and not dst.any()


# ---- pinned host memory from a thread that made no CUDA call ------------------------------------------------------

def _in_fresh_thread(fn: Callable[[], None]) -> None:
    """``fn`` in a new thread (one that has made no CUDA call: no current context); its exception re-raised here."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            errors.append(e)
    t = threading.Thread(target=run)
    t.start()
    t.join()
    if errors:
        raise errors[0]


def test_pinned_host_ops_run_from_a_thread_without_cuda_calls() -> None:
    """stage_window's dst, bookkeep's mirror and stage_batch's staging are pinned host memory whose device address the
    native op looks up, a lookup that needs a current context. An engine may stop (and flush the canary's last window)
    from a request thread that never made a CUDA call: transformers' generate_batch from a worker thread failed there
    with "dst must be pinned". Each op run from such a thread writes what the same call on this thread writes."""
    arena = torch.randint(-99, 99, (4 + 5 * 2,), generator=torch.Generator().manual_seed(5))
    arena[1] = 3
    views = {"head": arena[:4], "count": arena[1:2], "rows": arena[4:].view(5, 2), "reset": arena[1:3]}
    want = _window_on(arena, views, CUDA, "cuda", 11)
    a = arena.clone().to(CUDA)
    v = {k: a[t.storage_offset():t.storage_offset() + t.numel()].view(t.shape) for k, t in views.items()}
    dst = torch.full((1 + arena.numel(),), -7, dtype=torch.int64).pin_memory()
    _in_fresh_thread(lambda: stage_window(v["head"], v["count"], v["rows"], v["reset"], dst, 11, backend="cuda"))
    torch.cuda.synchronize()
    assert torch.equal(dst, want[0]) and torch.equal(a.cpu(), want[1])

    counter, values = torch.tensor([5], device=CUDA), torch.tensor([3, 4], device=CUDA)
    mirror = torch.full((3,), -1, dtype=torch.int64, pin_memory=True)
    op = bind_bookkeep(counter, counter[:0], counter[:0], "cuda", values, mirror)
    table = torch.zeros(1, 1, dtype=torch.int64, device=CUDA)
    _in_fresh_thread(lambda: op(table))
    torch.cuda.synchronize()
    assert mirror.tolist() == [6, 3, 4]

    src, staging, dst3, pad_rows, pad_tokens, padding_row = _stage_case(random.Random(4))
    outs = []
    for fresh in (False, True):
        d, s = [t.to(CUDA) for t in dst3], [t.to(CUDA) for t in src]
        pinned = staging.pin_memory()

        def call(d: list[torch.Tensor] = d, s: list[torch.Tensor] = s, pinned: torch.Tensor = pinned) -> None:
            stage_batch(s, pinned, *d, pad_rows, pad_tokens, padding_row, backend="cuda")
        if fresh:
            _in_fresh_thread(call)
        else:
            call()
        torch.cuda.synchronize()
        outs.append([t.cpu() for t in d])
    assert all(torch.equal(x, y) for x, y in zip(*outs, strict=True))


# ---- stage_batch -------------------------------------------------------------------------------------------------

def _stage_case(rng: random.Random) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor], int, int, int]:
    bs, nt, u = rng.randint(0, 300), rng.randint(0, 5000), rng.randint(1, 6)
    src = [torch.randint(-(1 << 31), (1 << 31) - 1, (bs if i < 3 else nt,),
                         dtype=rng.choice([torch.int32, torch.int64])) for i in range(6)]
    rc, tc = bs + rng.randint(0, 300), nt + rng.randint(0, 3000)
    staging = torch.randint(-(1 << 62), 1 << 62, (u, bs + rng.randint(0, 5)))
    dst = [torch.randint(-50, 50, shape) for shape in ((3, rc), (u, rc), (3, tc))]
    return src, staging, dst, rng.randint(bs, rc), rng.randint(nt, tc), rng.choice([-1, 0, 7])


@pytest.mark.parametrize("seed", range(20))
def test_stage_batch_matches(seed: int) -> None:
    src, staging, dst, pad_rows, pad_tokens, padding_row = _stage_case(random.Random(seed))
    outs = {}
    for backend, dev in (("cpu", "cpu"), ("cuda", CUDA), ("torch", CUDA)):
        d = [t.to(dev) for t in dst]
        stage_batch([t.to(dev) for t in src], staging.pin_memory(), *d, pad_rows, pad_tokens, padding_row,
                    backend=backend)
        outs[backend] = [t.cpu() for t in d]
    for backend in ("cuda", "torch"):
        assert all(torch.equal(a, b) for a, b in zip(outs["cpu"], outs[backend], strict=True)), backend


def test_stage_batch_needs_pinned_staging() -> None:
    src, staging, dst, pad_rows, pad_tokens, padding_row = _stage_case(random.Random(1))
    d = [t.to(CUDA) for t in dst]
    with pytest.raises(CanaryInputError, match="pinned"):
        stage_batch([t.to(CUDA) for t in src], staging, *d, pad_rows, pad_tokens, padding_row, backend="cuda")
    assert all(torch.equal(a.cpu(), b) for a, b in zip(d, dst, strict=True))


def test_stage_batch_replays_in_a_graph() -> None:
    """Captured once, replayed on new batch values and new staging contents (read in place at replay time)."""
    rng = random.Random(3)
    src, staging, dst, pad_rows, pad_tokens, padding_row = _stage_case(rng)
    gsrc, gstaging, gdst = [t.to(CUDA) for t in src], staging.pin_memory(), [t.to(CUDA) for t in dst]
    side, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        stage_batch(gsrc, gstaging, *gdst, pad_rows, pad_tokens, padding_row, backend="cuda")
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(3):
        for t in gsrc:
            t.copy_(torch.randint(-1000, 1000, t.shape, dtype=t.dtype))
        gstaging.copy_(torch.randint(-1000, 1000, gstaging.shape))
        want = [t.clone() for t in gdst]
        stage_batch([t.clone() for t in gsrc], gstaging.clone(), *want, pad_rows, pad_tokens, padding_row,
                    backend="torch")
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(gdst, want, strict=True))


# ---- begin_decode ------------------------------------------------------------------------------------------------

def _decode_case(rng: random.Random, inline: bool = False) -> dict[str, Any]:
    """A batch over R rows, mostly steady (mostly one new token a row, some several or none; some rows rewound, some
    tokens unknown or out of range; reuse ends or none); ``inline``: at most STAGE_INLINE_ROWS rows (the CUDA op passes
    the staging rows in its launch), else more."""
    rows_n = rng.randint(2, 400)
    bs = rng.randint(0, STAGE_INLINE_ROWS) if inline else rng.randint(STAGE_INLINE_ROWS + 1, 300)
    n = torch.randint(0, 5000, (rows_n,)).numpy()
    rows = [rng.randrange(rows_n) for _ in range(bs)]
    live = [rng.random() < 0.9 for _ in range(bs)]
    steady = rng.random() < 0.7
    pre = [int(n[r]) if steady or rng.random() < 0.9 else rng.randint(0, 5000) for r in rows]
    ext = [1 if rng.random() < 0.7 else rng.randint(0, 4) for _ in live]
    nt = sum(ext) + rng.randint(0, 3)
    new = [-1 if rng.random() < 0.05 else rng.randrange(TOKEN_LIMIT) for _ in range(nt)]
    if nt and rng.random() < 0.15:
        new[rng.randrange(nt)] = TOKEN_LIMIT  # a bad value, if a live row's token
    return {"src": [torch.tensor(v, dtype=torch.int64) for v in (rows, pre, ext)] +
            [torch.randint(0, 1000, (nt,), dtype=rng.choice([torch.int32, torch.int64])) for _ in range(3)],
            "staging": torch.randint(-9, 9, (5, bs + rng.randint(0, 3))),
            "dst": [torch.randint(-50, 50, shape) for shape in ((3, bs + 5), (5, bs + 5), (3, nt + 7))],
            "pads": (bs + rng.randint(0, 5), nt + rng.randint(0, 7)),
            "host": tuple(np.array(v, np.int64) for v in (rows, pre, ext)), "new": np.array(new, np.int64),
            "live": np.array(live, bool), "h": torch.randint(-(1 << 62), 1 << 62, (rows_n,)).numpy(), "n": n,
            "seen": np.full(rows_n, -1, np.int64), "prefix": np.zeros(rows_n, np.int64),
            "reuse": np.array([rng.randint(0, 5000) for _ in rows], np.int64) if rng.random() < 0.5 else None}


STEADY_SEED = 0  # a pinned-staging case that begin_decode stages (result >= 0)
SLEEP_CYCLES = 50_000_000  # torch.cuda._sleep: tens of ms of GPU time, far longer than a begin_decode call


def _run_decode(c: dict[str, Any], backend: str, dev: str, pinned: bool = True) -> tuple[int, list[torch.Tensor]]:
    """One begin_decode on copies of the case; returns its result and every buffer it may write, on the host."""
    staging = c["staging"].clone().pin_memory() if pinned else c["staging"].clone()
    dst = [t.to(dev) for t in c["dst"]]
    state = [c[k].copy() for k in ("h", "n", "seen", "prefix")]
    got = begin_decode([t.to(dev) for t in c["src"]], staging, *dst, *c["pads"], 0, c["host"], c["new"], c["live"],
                       state[0], state[1], 0, state[2], state[3], 7, backend=backend, reuse=c["reuse"])
    return got, [staging, *(t.cpu() for t in dst), *(torch.from_numpy(a) for a in state)]


@pytest.mark.parametrize("inline", [False, True])
@pytest.mark.parametrize("seed", range(16))
def test_begin_decode_matches(seed: int, inline: bool) -> None:
    """CUDA (host decode + the staging launch) against the C++ CPU op and the torch reference on the device; a batch of
    at most STAGE_INLINE_ROWS rows leaves the CUDA op's staging buffer as it was (its rows travel in the launch)."""
    c = _decode_case(random.Random(seed), inline)
    outs = {b: _run_decode(c, b, dev) for b, dev in (("cpu", "cpu"), ("cuda", CUDA), ("torch", CUDA))}
    for backend in ("cuda", "torch"):
        got, want = outs[backend][1], outs["cpu"][1]
        if inline and backend == "cuda":
            assert torch.equal(got[0], c["staging"])
            got, want = got[1:], want[1:]
        assert outs[backend][0] == outs["cpu"][0], backend
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True)), backend


def test_begin_decode_inline_needs_no_pinned_staging() -> None:
    """A batch of at most STAGE_INLINE_ROWS rows never touches the staging buffer: pageable staging is accepted and
    the result matches the C++ CPU op."""
    c = _decode_case(random.Random(3), inline=True)
    want = _run_decode(c, "cpu", "cpu")
    got = _run_decode(c, "cuda", CUDA, pinned=False)
    assert got[0] == want[0] and torch.equal(got[1][0], c["staging"])
    assert all(torch.equal(a, b) for a, b in zip(want[1][1:], got[1][1:], strict=True))


@pytest.mark.parametrize("part", ["awaits", "records"])
def test_begin_decode_awaits_and_records_its_staging_event(part: str) -> None:
    """With an event (pinned staging: more than STAGE_INLINE_ROWS rows), the CUDA op waits for the event's last record
    before it writes the staging rows (behind a long kernel, a marker recorded just before that record has completed
    once the call returns), and records it again after the launch that reads them (with the long kernel queued after
    the last record, the event is pending once the call returns). The results match the C++ CPU op's."""
    c = _decode_case(random.Random(STEADY_SEED))
    want = _run_decode(c, "cpu", "cpu")
    staging, dst = c["staging"].clone().pin_memory(), [t.to(CUDA) for t in c["dst"]]
    src = [t.to(CUDA) for t in c["src"]]
    state = [c[k].copy() for k in ("h", "n", "seen", "prefix")]
    guard, marker = torch.cuda.Event(), torch.cuda.Event()
    if part == "records":
        guard.record()
    torch.cuda._sleep(SLEEP_CYCLES)
    if part == "awaits":  # the marker first: the guard's completion implies the marker's
        marker.record()
        guard.record()
    got = begin_decode(src, staging, *dst, *c["pads"], 0, c["host"], c["new"], c["live"], state[0], state[1], 0,
                       state[2], state[3], 7, backend="cuda", reuse=c["reuse"], event=guard.cuda_event)
    pending = not (marker if part == "awaits" else guard).query()
    torch.cuda.synchronize()
    assert got == want[0] >= 0
    assert pending == (part == "records")
    assert all(torch.equal(a, b) for a, b in zip(want[1][1:], [*(t.cpu() for t in dst),
                                                              *(torch.from_numpy(a) for a in state)], strict=True))


def test_begin_decode_needs_pinned_staging_and_writes_nothing() -> None:
    """Pageable staging (read by a batch of more than STAGE_INLINE_ROWS rows) is an input error found before the
    decode: no row state, staging or buffer changes."""
    c = _decode_case(random.Random(5))
    staging, dst = c["staging"].clone(), [t.to(CUDA) for t in c["dst"]]
    state = [c[k].copy() for k in ("h", "n", "seen", "prefix")]
    with pytest.raises(CanaryInputError, match="pinned"):
        begin_decode([t.to(CUDA) for t in c["src"]], staging, *dst, *c["pads"], 0, c["host"], c["new"], c["live"],
                     state[0], state[1], 0, state[2], state[3], 7, backend="cuda")
    assert all(np.array_equal(a, c[k]) for a, k in zip(state, ("h", "n", "seen", "prefix"), strict=True))
    assert torch.equal(staging, c["staging"]) and all(torch.equal(a.cpu(), b) for a, b in zip(dst, c["dst"],
                                                                                             strict=True))
