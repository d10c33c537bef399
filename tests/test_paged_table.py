"""Paged slot tables (table_page > 1, vLLM block tables): hand vectors and a differential against the per-token table.

A block table ``[R, B]`` with page P means exactly the per-token table ``[R, B * P]`` whose cell (r, c) is
``b * P + c % P`` for ``b = table[r, c // P] >= 0`` and ``b`` otherwise (docs/ops-contract.md 0). The per-token path
(page 1) is pinned by tests/test_plan.py and tests/test_verify.py against Python oracles; here every backend's paged
result must equal that oracle on the expanded table, bit for bit.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from kvcanary.errors import CanaryInputError
from kvcanary.ops import hashes as H
from kvcanary.ops.plan import plan_forward
from kvcanary.ops.types import Fingerprint, GroupView, Sink
from kvcanary.ops.verify import verify
from kvcanary.ops.write import write
from kvcanary_schema import (
    NUM_PLAN_COLS,
    NUM_PLAN_STATUS_COLS,
    FailReason,
    FingerprintMode,
    Group,
    PlanCol,
    Stage,
    ViolationCol,
    WriteCheck,
)
from test_plan import oracle_forward
from test_verify import counters_of, fp_int, make_sources, oracle_verify

BACKENDS = ("torch", "cpu")
PAGES = (1, 16, 32, 5, 3)


def expand(blocks: list[list[int]], page: int) -> list[list[int]]:
    """The per-token table a block table stands for (the contract, on Python ints)."""
    return [[b * page + c % page if b >= 0 else b for c in range(len(row) * page) for b in (row[c // page],)]
            for row in blocks]


def _plan(table: torch.Tensor, page: int, rows: list[int], pre: list[int], ext: list[int], backend: str,
          window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    dev = "cuda" if backend == "cuda" else "cpu"
    plan = torch.full((len(rows) + 4, NUM_PLAN_COLS), -9, dtype=torch.int64, device=dev)
    status = torch.zeros(NUM_PLAN_STATUS_COLS, dtype=torch.int64, device=dev)
    i64 = torch.int64
    plan_forward(plan, status, torch.tensor(rows, dtype=i64, device=dev), torch.tensor(pre, dtype=i64, device=dev),
                 torch.tensor(ext, dtype=i64, device=dev), table.to(dev), sum(max(e, 0) for e in ext), window=window,
                 table_page=page, backend=backend)
    return plan.cpu(), status.cpu()


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_vectors(backend: str) -> None:
    # row 0: blocks 3, 0, -1 (page 4: positions 0-3 -> slots 12-15, 4-7 -> 0-3, 8-11 -> -1)
    # row 1: blocks 1, 2, 5
    table = torch.tensor([[3, 0, -1], [1, 2, 5]], dtype=torch.int32)
    plan, status = _plan(table, 4, [0, 1, 1], [6, 9, 12], [2, 0, 0], backend, window=3)
    assert status[0].item() == 3  # NUM_SEGMENTS
    seg = plan[:3].tolist()
    # row 0, prefix 6: seed = position 5 -> block 0, offset 1 -> slot 1; window 3 -> first prev = position 2 -> 14
    assert seg[0][PlanCol.SEED_SLOT] == 1 and seg[0][PlanCol.FIRST_PREV_SLOT] == 14
    # row 1, prefix 9: seed = position 8 -> block 5, offset 0 -> slot 20; first prev = position 5 -> block 2 -> 9
    assert seg[1][PlanCol.SEED_SLOT] == 20 and seg[1][PlanCol.FIRST_PREV_SLOT] == 9
    # row 1, prefix 12 (the whole row, L = 3 * 4): seed = position 11 -> slot 23
    assert seg[2][PlanCol.SEED_SLOT] == 23
    # a prefix past the logical row length is an input error
    _, st = _plan(table, 4, [0], [13], [0], backend)
    assert st[0].item() == 0 and st[3].item() == 1
    # a negative block id reads as itself: row 0, prefix 10 -> seed slot -1
    plan, _ = _plan(table, 4, [0], [10], [0], backend)
    assert plan[0, PlanCol.SEED_SLOT].item() == -1


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_page_is_a_clear_error(backend: str) -> None:
    table = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(CanaryInputError, match="table_page"):
        _plan(table, 0, [0], [1], [0], backend)
    with pytest.raises(CanaryInputError, match="position range"):
        _plan(table, 1 << 40, [0], [1], [0], backend)


def _paged_case(rng: random.Random, page: int) -> tuple[list[list[int]], int, list[list[int]]]:
    """A random block table over ``nb`` blocks (permuted, some bad ids): (blocks, num_slots, expanded table)."""
    nb = rng.randint(2, 12)
    R, B = rng.randint(1, 5), rng.randint(1, 4)
    perm = list(range(nb))
    rng.shuffle(perm)
    blocks = [[perm[(r * B + c) % nb] for c in range(B)] for r in range(R)]
    for _ in range(rng.choice([0, 0, 1, 2])):
        blocks[rng.randrange(R)][rng.randrange(B)] = rng.choice([-1, -3, nb, nb + 5])
    return blocks, nb * page, expand(blocks, page)


@pytest.mark.parametrize("page", PAGES)
def test_plan_differential_vs_expanded_table(page: int) -> None:
    rng = random.Random(1000 + page)
    for _ in range(120):
        blocks, _, wide = _paged_case(rng, page)
        R, L = len(blocks), len(wide[0])
        bs = rng.randint(0, R + 2)
        rows = [rng.choice([rng.randrange(R), rng.randrange(R), -1, R]) for _ in range(bs)]
        pre = [rng.randint(-1, L + 1) for _ in range(bs)]
        ext = [rng.randint(0, max(0, L - max(p, 0))) for p in pre]
        window = rng.choice([0, 0, 1, page + 1])
        seg, st = oracle_forward(rows, pre, ext, wide, sum(ext), window=window)
        dtype = rng.choice([torch.int32, torch.int64])
        for backend in BACKENDS:
            plan, status = _plan(torch.tensor(blocks, dtype=dtype), page, rows, pre, ext, backend, window)
            assert status.tolist() == st, backend
            assert plan[:len(seg)].tolist() == seg, backend


def _records(rng: random.Random, wide: list[list[int]], num_slots: int, fp: Fingerprint | None,
             lengths: list[int]) -> tuple[torch.Tensor, list[list[int]]]:
    """Records as a correct engine writes them along each row of the per-token table, then a few corrupted."""
    records = torch.zeros(num_slots, 2, 4, dtype=torch.int64)
    truth = [[rng.randrange(50) for _ in row] for row in wide]
    for r, row in enumerate(wide):
        hv = H.CHAIN_H0
        for k in range(lengths[r]):
            s = row[k]
            if 0 <= s < num_slots:
                for h in range(2):
                    f = fp_int(fp.sources, h, s, k, fp.mode, fp.layer_stride) if fp is not None else 0
                    records[s, h] = torch.tensor([truth[r][k], k, H.to_i64(hv), f])
            hv = H.chain_step_int(hv, truth[r][k], k)
    for _ in range(rng.choice([0, 1, 3])):
        records[rng.randrange(num_slots), rng.randrange(2), rng.randrange(4)] += rng.choice([1, -1, 1 << 40])
    return records, truth


@pytest.mark.parametrize("page", PAGES)
def test_verify_differential_vs_expanded_table(page: int) -> None:
    rng = random.Random(2000 + page)
    seen_rows = 0
    for _ in range(60):
        blocks, S, wide = _paged_case(rng, page)
        R, L = len(blocks), len(wide[0])
        lengths = [rng.randint(0, L) for _ in range(R)]
        stage = rng.choice([Stage.HEAD, Stage.TAIL])
        fp = None
        if stage == Stage.TAIL and rng.random() < 0.5:
            fp = Fingerprint(make_sources(rng, 2, S), FingerprintMode.ALL, 1)
        records, _ = _records(rng, wide, S, fp, lengths)
        group = GroupView(records, Group.FULL, rng.choice([0, 1]))
        rows = [rng.randrange(R) for _ in range(rng.randint(1, R + 1))]
        pre = [rng.randint(0, lengths[r]) for r in rows]
        dtype = rng.choice([torch.int32, torch.int64])
        paged = torch.tensor(blocks, dtype=dtype)
        plan, status = _plan(paged, page, rows, pre, [0] * len(rows), "torch", rng.choice([0, 0, page]))
        want = oracle_verify(group, stage, plan, status, torch.tensor(wide, dtype=torch.int64), 7, None, fp)
        seen_rows += len(want.rows)
        for backend in BACKENDS:
            sink = Sink.allocate(4096)
            sink.step.fill_(7)
            verify(group, stage, plan, status, paged, sink, fingerprint=fp, table_page=page, backend=backend)
            got = [tuple(r) for r in sink.rows[:int(sink.count)].tolist()]
            assert Counter(got) == Counter(want.rows), backend
            assert torch.equal(sink.counters, counters_of(want)), backend
    assert seen_rows > 0  # the corruptions and bad block ids must produce rows, else this proves little



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("page", PAGES)
def test_cuda_paged_plan_and_verify_match_the_expanded_oracle(page: int) -> None:
    rng = random.Random(3000 + page)
    for _ in range(60):
        blocks, S, wide = _paged_case(rng, page)
        R, L = len(blocks), len(wide[0])
        rows = [rng.randrange(R) for _ in range(rng.randint(1, R + 1))]
        lengths = [rng.randint(0, L) for _ in range(R)]
        pre = [rng.randint(0, lengths[r]) for r in rows]
        ext = [rng.randint(0, L - p) for p in pre]
        window = rng.choice([0, page + 1])
        seg, st = oracle_forward(rows, pre, ext, wide, sum(ext), window=window)
        paged = torch.tensor(blocks, dtype=rng.choice([torch.int32, torch.int64]))
        plan, status = _plan(paged, page, rows, pre, ext, "cuda", window)
        assert status.tolist() == st and plan[:len(seg)].tolist() == seg
        records, _ = _records(rng, wide, S, None, lengths)
        stage = rng.choice([Stage.HEAD, Stage.TAIL])
        want = oracle_verify(GroupView(records, Group.FULL, 0), stage, plan, status,
                             torch.tensor(wide, dtype=torch.int64), 7, None, None)
        sink = Sink.allocate(4096, "cuda")
        sink.step.fill_(7)
        verify(GroupView(records.cuda(), Group.FULL, 0), stage, plan.cuda(), status.cuda(), paged.cuda(), sink,
               table_page=page, backend="cuda")
        got = [tuple(r) for r in sink.rows[:int(sink.count)].tolist()]
        assert Counter(got) == Counter(want.rows)
        assert torch.equal(sink.counters.cpu(), counters_of(want))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page", PAGES)
def test_write_structural_check_on_a_block_table_equals_the_expanded_table(backend: str, page: int) -> None:
    """The write's structural check reads the block table like plan and verify: same records, rows and counters as
    the expanded per-token table, with some tokens written to the slot their block maps and some elsewhere."""
    _paged_write_case(backend, page)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("page", PAGES)
def test_cuda_paged_write_matches_the_expanded_table(page: int) -> None:
    _paged_write_case("cuda", page)


def _paged_write_case(backend: str, page: int) -> None:
    dev = "cuda" if backend == "cuda" else "cpu"
    rng = random.Random(page)
    rows, blocks_per_row, num_slots = 4, 3, 64 * page
    blocks = [[rng.randrange(1, 64) for _ in range(blocks_per_row)] for _ in range(rows)]
    full = torch.tensor(expand(blocks, page), dtype=torch.int64)
    req_rows, pre, ext = [0, 2, 3], [1, page, 2], [2, page + 1, 1]
    ids, pos, loc = [], [], []
    for r, p0, e in zip(req_rows, pre, ext, strict=True):
        for j in range(e):
            ids.append(rng.randrange(1000))
            pos.append(p0 + j)
            right = int(full[r, p0 + j])
            loc.append(right if rng.random() < 0.6 else rng.randrange(1, num_slots))
    out = []
    for table, pg in ((torch.tensor(blocks, dtype=torch.int32), page), (full, 1)):
        records = torch.zeros(num_slots, 2, 4, dtype=torch.int64, device=dev)
        g = GroupView(records, Group.FULL, reserved_slots=1)
        plan, status = _plan(table, pg, req_rows, pre, ext, backend)
        sink = Sink.allocate(64, device=torch.device(dev))
        i64 = {"dtype": torch.int64, "device": dev}
        write(g, Stage.HEAD, plan.to(dev), status.to(dev), table.to(dev), torch.tensor(ids, **i64),
              torch.tensor(pos, **i64), torch.tensor(loc, **i64), sink, checks=int(WriteCheck.STRUCTURAL),
              table_page=pg, backend=backend)
        out.append((records.cpu(), Counter(map(tuple, sink.rows[: int(sink.count[0])].tolist())),
                    sink.counters.cpu()))
    (rec_p, rows_p, cnt_p), (rec_f, rows_f, cnt_f) = out
    assert torch.equal(rec_p, rec_f) and rows_p == rows_f and torch.equal(cnt_p, cnt_f)
    wrong = sum(lc != int(full[r, p]) for r, p, lc in zip(
        [r for r, e in zip(req_rows, ext, strict=True) for _ in range(e)], pos, loc, strict=True))
    assert sum(1 for row in rows_p if row[ViolationCol.REASONS] & int(FailReason.STRUCTURAL)) == wrong
