"""The structural write check on CUDA: padded decode batches and misplaced out_cache_loc, bit-exact with the torch
reference and the CPU backend, eagerly and inside a captured CUDA graph."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from kvcanary.ops.plan import plan_forward
from kvcanary.ops.types import GroupView, Sink
from kvcanary.ops.verify import verify
from kvcanary.ops.write import write
from kvcanary_schema import NO_SLOT, NUM_PLAN_COLS, NUM_PLAN_STATUS_COLS, FailReason, PlanStatusCol, Stage, ViolationCol

from .helpers import ALL_CHECKS, assert_sinks_equal

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CUDA = "cuda"
RESERVED = 2


@dataclass
class Decode:
    """A padded batch: request rows, then padding rows (row = padding_row) mixed in; some writes misplaced."""

    table: torch.Tensor  # [bs + 1, width]; the last row is the padding row
    req_pool_indices: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    padding_row: int
    misplaced: int  # writes that must be reported STRUCTURAL


def make_decode(seed: int, bs: int, n_pad: int, width: int, max_ext: int = 1, i32: bool = False,
                bad: float = 0.05) -> Decode:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    slots = (torch.randperm(bs * width, generator=gen) + RESERVED).view(bs, width)
    table = torch.cat([slots, torch.full((1, width), NO_SLOT)]).to(torch.int32 if i32 else torch.int64)
    pres = [rng.randrange(1, width - max_ext) for _ in range(bs)]
    exts = [rng.randrange(1, max_ext + 1) for _ in range(bs)]
    prefix_slots = [int(slots[r, i]) for r in range(bs) for i in range(pres[r])]
    rng.shuffle(prefix_slots)  # live slots no token of this batch writes: misplaced writes collide with nothing
    rows = [(r, pres[r], exts[r]) for r in range(bs)]
    for _ in range(n_pad):
        rows.insert(rng.randrange(len(rows) + 1) if rng.random() < 0.3 else len(rows), (bs, 0, 1))
    ids, pos, loc, misplaced = [], [], [], 0
    for r, p, e in rows:
        for j in range(e):
            x = rng.random()
            if r == bs:  # padding: the reserved slots, nothing, a live slot or an out-of-range value
                lc = rng.randrange(RESERVED) if x >= bad else rng.choice([NO_SLOT, int(slots[0, 0]), bs * width + 9])
                misplaced += lc >= RESERVED
            elif x < bad and prefix_slots:
                lc = prefix_slots.pop()
                misplaced += 1
            else:
                lc = int(slots[r, p + j])
            ids.append(rng.randrange(150_000))
            pos.append(0 if r == bs else p + j)
            loc.append(lc)

    def t(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int64)

    return Decode(table, t([r[0] for r in rows]), t([r[1] for r in rows]), t([r[2] for r in rows]), t(ids), t(pos),
                  t(loc), bs, misplaced)


RING = 1 << 17  # every verify row of random records fits: rows compare as multisets


def num_slots(d: Decode) -> int:
    return (d.table.shape[0] - 1) * d.table.shape[1] + RESERVED


def run(d: Decode, backend: str, dev: str, records: torch.Tensor, step: int = 3) -> dict[str, torch.Tensor | Sink]:
    """plan (padding row) -> HEAD verify -> HEAD write with every check, on a copy of ``records``."""
    group = GroupView(records.clone().to(dev), reserved_slots=RESERVED)
    plan = torch.full((d.req_pool_indices.shape[0], NUM_PLAN_COLS), -9, dtype=torch.int64, device=dev)
    status = torch.zeros(NUM_PLAN_STATUS_COLS, dtype=torch.int64, device=dev)
    sink = Sink.allocate(RING, dev)
    sink.step.fill_(step)
    table = d.table.to(dev)
    plan_forward(plan, status, d.req_pool_indices.to(dev), d.prefix_lens.to(dev), d.extend_lens.to(dev), table,
                 int(d.input_ids.shape[0]), padding_row=d.padding_row, backend=backend)
    verify(group, Stage.HEAD, plan, status, table, sink, backend=backend)
    write(group, Stage.HEAD, plan, status, table, d.input_ids.to(dev), d.positions.to(dev), d.out_cache_loc.to(dev),
          sink, checks=ALL_CHECKS, backend=backend)
    return {"plan": plan, "status": status, "records": group.records, "sink": sink}


def assert_same(x: dict[str, torch.Tensor | Sink], y: dict[str, torch.Tensor | Sink], what: str) -> None:
    sx, sy = x["status"], y["status"]
    assert isinstance(sx, torch.Tensor) and isinstance(sy, torch.Tensor)
    assert torch.equal(sx.cpu(), sy.cpu()), what
    n = int(sx[PlanStatusCol.NUM_SEGMENTS])
    px, py, rx, ry = x["plan"], y["plan"], x["records"], y["records"]
    assert isinstance(px, torch.Tensor) and isinstance(py, torch.Tensor)
    assert isinstance(rx, torch.Tensor) and isinstance(ry, torch.Tensor)
    assert torch.equal(px[:n].cpu(), py[:n].cpu()), f"{what}: plan"
    assert torch.equal(rx.cpu(), ry.cpu()), f"{what}: records"
    kx, ky = x["sink"], y["sink"]
    assert isinstance(kx, Sink) and isinstance(ky, Sink)
    assert_sinks_equal(kx, ky, what)


def structural_rows(sink: Sink) -> int:
    n = min(int(sink.count[0]), sink.capacity)
    return int(((sink.rows[:n, ViolationCol.REASONS] & int(FailReason.STRUCTURAL)) != 0).sum())


CASES = [
    {"bs": 1, "n_pad": 3, "width": 40, "bad": 0.5},
    {"bs": 7, "n_pad": 1, "width": 300, "i32": True, "bad": 0.3},
    {"bs": 200, "n_pad": 56, "width": 64, "bad": 0.1},  # the one-block serial path (decode, <= 256 rows)
    {"bs": 300, "n_pad": 20, "width": 50},  # more rows than threads: the scan path
    {"bs": 40, "n_pad": 8, "width": 900, "max_ext": 100, "i32": True},  # extend-sized segments: tiles
    {"bs": 3, "n_pad": 2, "width": 6000, "max_ext": 3000},  # segments spanning several tiles
]


@pytest.mark.parametrize("k", range(len(CASES)))
@pytest.mark.parametrize("seed", range(3))
def test_padded_batches_match_reference_and_cpu(k: int, seed: int) -> None:
    d = make_decode(17 * k + seed, **CASES[k])  # type: ignore[arg-type]
    records = torch.randint(-2**40, 2**40, (num_slots(d), 2, 4), generator=torch.Generator().manual_seed(seed))
    got = run(d, "cuda", CUDA, records)
    assert_same(got, run(d, "torch", CUDA, records), f"case {k} seed {seed} vs torch")
    assert_same(got, run(d, "cpu", "cpu", records), f"case {k} seed {seed} vs cpu")
    sink = got["sink"]
    assert isinstance(sink, Sink)
    assert structural_rows(sink) == d.misplaced  # the oracle: every misplaced write, nothing else


def test_graph_capture_and_replay_reports_misplaced_writes() -> None:
    bs, n_pad, width = 24, 8, 128
    first = make_decode(0, bs, n_pad, width, bad=0.0)
    T = int(first.input_ids.shape[0])
    names = ("table", "req_pool_indices", "prefix_lens", "extend_lens", "input_ids", "positions", "out_cache_loc")
    static = {name: getattr(first, name).clone().to(CUDA) for name in names}
    zeros = torch.zeros(num_slots(first), 2, 4, dtype=torch.int64)
    group = GroupView(zeros.to(CUDA), reserved_slots=RESERVED)
    plan = torch.zeros(bs + n_pad, NUM_PLAN_COLS, dtype=torch.int64, device=CUDA)
    status = torch.zeros(NUM_PLAN_STATUS_COLS, dtype=torch.int64, device=CUDA)
    sink = Sink.allocate(RING, CUDA)

    def bracket() -> None:
        plan_forward(plan, status, static["req_pool_indices"], static["prefix_lens"], static["extend_lens"],
                     static["table"], T, padding_row=bs, backend="cuda")
        verify(group, Stage.HEAD, plan, status, static["table"], sink, backend="cuda")
        write(group, Stage.HEAD, plan, status, static["table"], static["input_ids"], static["positions"],
              static["out_cache_loc"], sink, checks=ALL_CHECKS, backend="cuda")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        bracket()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bracket()
    for seed in range(1, 5):
        d = make_decode(seed, bs, n_pad, width, bad=0.15)
        assert int(d.input_ids.shape[0]) == T  # a graph replays one shape (decode: one token per row)
        for name, tnsr in static.items():
            tnsr.copy_(getattr(d, name).to(CUDA))
        group.records.zero_()
        for tnsr in (sink.rows, sink.count, sink.counters):
            tnsr.zero_()
        sink.step.fill_(seed)
        graph.replay()
        torch.cuda.synchronize()
        ref = run(d, "torch", CUDA, zeros, step=seed)
        assert_same({"plan": plan, "status": status, "records": group.records, "sink": sink}, ref, f"replay {seed}")
        assert structural_rows(sink) == d.misplaced > 0, seed
