"""Shared GPU test helpers: move CPU scenarios to CUDA, build large realistic batches, run a whole bracket."""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from kvcanary.ops.hashes import to_i64
from kvcanary.ops.plan import plan_forward
from kvcanary.ops.types import Fingerprint, FingerprintSources, GroupView, Sink, SourceSpec, TokenPool
from kvcanary.ops.verify import verify
from kvcanary.ops.write import write
from kvcanary.truth import ChainHasher
from kvcanary_schema import (
    NUM_PLAN_COLS,
    NUM_PLAN_STATUS_COLS,
    FingerprintMode,
    Group,
    PlanCol,
    PlanStatusCol,
    Stage,
    WriteCheck,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the CPU test modules' scenario generators

ALL_CHECKS = int(WriteCheck.CHAIN_POSITION | WriteCheck.INPUTS | WriteCheck.STRUCTURAL)


def sources_to(src: FingerprintSources, device: str) -> FingerprintSources:
    """The same sources (same bytes, same layout) on another device."""
    halves = [[SourceSpec(s.tensor.to(device), s.page_size, s.bytes_per_token, s.read_bytes) for s in h]
              for h in src.halves]
    return FingerprintSources(halves, src.num_slots)


def fp_to(fp: Fingerprint | None, device: str) -> Fingerprint | None:
    return None if fp is None else Fingerprint(sources_to(fp.sources, device), fp.mode, fp.layer_stride, fp.share)


def group_to(g: GroupView, device: str) -> GroupView:
    return GroupView(g.records.to(device), g.group, g.reserved_slots,
                     None if g.swa_map is None else g.swa_map.to(device))


def pool_to(p: TokenPool | None, device: str) -> TokenPool | None:
    return None if p is None else TokenPool(p.tokens.to(device), p.lens.to(device), p.offset)


def consistent_entry_offsets(plan: torch.Tensor, status: torch.Tensor) -> None:
    """Rewrite ENTRY_OFFSET as the exclusive sum of verify lengths (the contract's plan invariant; arbitrary test
    plans break it, and the CUDA kernel derives entries from it)."""
    n = max(0, min(int(status[PlanStatusCol.NUM_SEGMENTS]), plan.shape[0]))
    if n == 0:
        return
    lens = (plan[:n, PlanCol.IDX_END] - plan[:n, PlanCol.IDX_BEGIN]).clamp(min=0)
    plan[:n, PlanCol.ENTRY_OFFSET] = torch.cumsum(lens, 0) - lens


def sink_rows(sink: Sink, skip: int = 0) -> list[tuple[int, ...]]:
    n = min(int(sink.count[0]), sink.capacity)
    return sorted(tuple(r) for r in sink.rows[skip:n].tolist())


def assert_sinks_equal(a: Sink, b: Sink, what: str, skip: int = 0) -> None:
    assert int(a.count[0]) == int(b.count[0]), f"{what}: ring count {int(a.count[0])} != {int(b.count[0])}"
    assert torch.equal(a.counters.cpu(), b.counters.cpu()), f"{what}: counters\n{a.counters}\n{b.counters}"
    if int(a.count[0]) <= a.capacity:
        assert sink_rows(a, skip) == sink_rows(b, skip), f"{what}: ring rows differ"


# ---- large realistic batches ------------------------------------------------------------------------------------

@dataclass
class Batch:
    """One forward of a batch, with HEAD/TAIL buffers holding correct prefix records (then corrupted)."""

    head: GroupView
    tail: GroupView
    table: torch.Tensor
    rpi: torch.Tensor
    pre: torch.Tensor
    ext: torch.Tensor
    ids: torch.Tensor
    pos: torch.Tensor
    loc: torch.Tensor
    window: int
    pool: TokenPool | None
    fp: Fingerprint | None
    expect_prefix: torch.Tensor | None
    expect_new: torch.Tensor | None


def make_batch(seed: int, *, bs: int, prefix: int | list[int], ext: int | list[int], halves: int = 2,
               swa: bool = False, window: int = 0, fp_mode: FingerprintMode | None = None, fp_bytes: int = 256,
               contiguous: bool = False, corrupt: int = 3, pool: bool = False, expect: bool = False,
               reserved: int = 1, device: str = "cuda", pad_tokens: int = 0) -> Batch:
    """Build prefix records with the torch reference on ``device``, then corrupt ``corrupt`` record fields."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    pres = prefix if isinstance(prefix, list) else [prefix] * bs
    exts = ext if isinstance(ext, list) else [ext] * bs
    width = max(p + e for p, e in zip(pres, exts, strict=True)) + 1
    space = bs * width + reserved
    perm = torch.arange(reserved, space) if contiguous else reserved + torch.randperm(space - reserved, generator=gen)
    table = perm.view(bs, width).to(device)
    if swa:
        num_slots = space  # an identity-like but shuffled map with some evicted entries
        smap = torch.randperm(space - reserved, generator=gen) + reserved
        smap = torch.cat([torch.arange(reserved), smap])
        evict = torch.rand(space, generator=gen) < 0.02
        smap[evict] = -1
        swa_map: torch.Tensor | None = smap.to(device)
    else:
        num_slots, swa_map = space, None
    g = Group.SWA if swa else Group.FULL
    head = GroupView(torch.zeros(num_slots, halves, 4, dtype=torch.int64, device=device), g, reserved, swa_map)
    tail = GroupView(torch.zeros(num_slots, halves, 4, dtype=torch.int64, device=device), g, reserved, swa_map)
    truth = torch.randint(0, 150_000, (bs, width), generator=gen).to(device)
    fp = None
    if fp_mode is not None:
        srcs = [[SourceSpec(torch.randint(0, 256, (num_slots, fp_bytes), dtype=torch.uint8, generator=gen).to(device))]
                for _ in range(halves)]
        fp = Fingerprint(FingerprintSources(srcs, num_slots), fp_mode)
    rpi = torch.arange(bs, device=device)
    pre_t = torch.tensor(pres, device=device)
    ext_t = torch.tensor(exts, device=device)
    # Prefix records: one write of every prefix as new tokens (reference backend), both stages.
    if sum(pres):
        ar = torch.arange(width, device=device)
        m = ar[None, :] < pre_t[:, None]
        ids0 = truth[m]
        pos0 = ar[None, :].expand(bs, width)[m]
        loc0 = table[m]
        plan0 = torch.zeros(bs, NUM_PLAN_COLS, dtype=torch.int64, device=device)
        st0 = torch.zeros(NUM_PLAN_STATUS_COLS, dtype=torch.int64, device=device)
        plan_forward(plan0, st0, rpi, torch.zeros_like(pre_t), pre_t, table, int(ids0.shape[0]), backend="torch")
        s0 = Sink.allocate(16, device)
        write(head, Stage.HEAD, plan0, st0, table, ids0, pos0, loc0, s0, backend="torch")
        write(tail, Stage.TAIL, plan0, st0, table, ids0, pos0, loc0, s0, fingerprint=fp, backend="torch")
    for _ in range(corrupt):
        buf = rng.choice([head, tail]).records
        buf[rng.randrange(reserved, num_slots), rng.randrange(halves), rng.randrange(4)] += rng.choice([1, -1, 1 << 33])
    ar = torch.arange(width, device=device)
    m = (ar[None, :] >= pre_t[:, None]) & (ar[None, :] < (pre_t + ext_t)[:, None])
    ids = truth[m]
    pos = ar[None, :].expand(bs, width)[m]
    loc = table[m]
    if pad_tokens:
        ids = torch.cat([ids, torch.zeros(pad_tokens, dtype=torch.int64, device=device)])
        pos = torch.cat([pos, torch.zeros(pad_tokens, dtype=torch.int64, device=device)])
        loc = torch.cat([loc, torch.full((pad_tokens,), -1, dtype=torch.int64, device=device)])
    if corrupt and ids.numel():
        k = rng.randrange(ids.numel())
        ids[k] += 1  # one wrong new token (caught by the pool / expect_new checks)
    tp = None
    if pool:
        tp = TokenPool(truth.clone(), torch.full((bs,), width, dtype=torch.int64, device=device))
    ep = en = None
    if expect:
        hs = ChainHasher()
        tl = truth.tolist()
        epl, enl = [], []
        for i in range(bs):
            p, e = pres[i], exts[i]
            epl.append(hs.extend(i, tl[i][:p], 0) if p else 0)
            enl.append(hs.extend(i, tl[i][p:p + e], p))
        ep = torch.tensor([to_i64(v) for v in epl], device=device)
        en = torch.tensor([to_i64(v) for v in enl], device=device)
    return Batch(head, tail, table, rpi, pre_t, ext_t, ids, pos, loc, window, tp, fp, ep, en)


def clone_group(g: GroupView) -> GroupView:
    return replace(g, records=g.records.clone())


def run_bracket(b: Batch, backend: str, *, plan_cap: int | None = None, ring: int = 4096,
                checks: int = ALL_CHECKS, workspaces: tuple[torch.Tensor, torch.Tensor] | None = None,
                max_segment_entries: int = 0, carries: torch.Tensor | None = None
                ) -> dict[str, Any]:
    """plan -> HEAD verify -> HEAD write -> TAIL verify (fp) -> TAIL write (fp), on copies; returns every output.
    ``workspaces``: the HEAD and TAIL writes' look-back workspaces (ops.write.write_workspace);
    ``max_segment_entries``: the verifies' grid hint (ops.verify.verify); ``carries``: the HEAD write keeps its chain
    carries there and the TAIL write takes them (ops.write.write_carries), as the runtime's writes do."""
    dev = b.head.records.device
    ws = workspaces or (None, None)
    head, tail = clone_group(b.head), clone_group(b.tail)
    cap = plan_cap or b.rpi.shape[0]
    plan = torch.zeros(cap, NUM_PLAN_COLS, dtype=torch.int64, device=dev)
    status = torch.zeros(NUM_PLAN_STATUS_COLS, dtype=torch.int64, device=dev)
    sink = Sink.allocate(ring, dev)
    sink.step.fill_(5)
    plan_forward(plan, status, b.rpi, b.pre, b.ext, b.table, int(b.ids.shape[0]), window=b.window,
                 expect_prefix=b.expect_prefix, expect_new=b.expect_new, backend=backend)
    verify(head, Stage.HEAD, plan, status, b.table, sink, token_pool=b.pool, max_segment_entries=max_segment_entries,
           backend=backend)
    keep, take = (int(WriteCheck.RECORD_CARRIES), int(WriteCheck.REUSE_CARRIES)) if carries is not None else (0, 0)
    write(head, Stage.HEAD, plan, status, b.table, b.ids, b.pos, b.loc, sink, checks=checks | keep, token_pool=b.pool,
          workspace=ws[0], carries=carries, backend=backend)
    verify(tail, Stage.TAIL, plan, status, b.table, sink, token_pool=b.pool, fingerprint=b.fp,
           max_segment_entries=max_segment_entries, backend=backend)
    write(tail, Stage.TAIL, plan, status, b.table, b.ids, b.pos, b.loc, sink, checks=checks | take, token_pool=b.pool,
          fingerprint=b.fp, workspace=ws[1], carries=carries, backend=backend)
    return {"plan": plan, "status": status, "head": head.records, "tail": tail.records, "sink": sink}


def assert_brackets_equal(x: dict[str, Any], y: dict[str, Any], what: str) -> None:
    assert torch.equal(x["status"].cpu(), y["status"].cpu()), f"{what}: status {x['status']} {y['status']}"
    n = int(x["status"][PlanStatusCol.NUM_SEGMENTS])
    assert torch.equal(x["plan"][:n].cpu(), y["plan"][:n].cpu()), f"{what}: plan rows"
    assert torch.equal(x["head"].cpu(), y["head"].cpu()), f"{what}: HEAD records"
    assert torch.equal(x["tail"].cpu(), y["tail"].cpu()), f"{what}: TAIL records"
    assert_sinks_equal(x["sink"], y["sink"], what)
