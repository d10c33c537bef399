"""The default policy's kernels on CUDA vs the torch reference and the CPU backend, bit for bit: the seal (ALL mode over
every layer, block-cooperative) for few tokens x many layers, the reuse plan folded into the forward plan, the
fingerprint share, the rolling sweep's one-slot segments; and the whole policy bracket captured and replayed."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from kvcanary.ops.fingerprint import fingerprint
from kvcanary.ops.plan import plan_forward, plan_sweep
from kvcanary.ops.types import Fingerprint, FingerprintSources, GroupView, Sink, SourceSpec
from kvcanary.ops.verify import verify
from kvcanary.ops.write import write
from kvcanary_schema import NO_SLOT, NUM_PLAN_COLS, NUM_PLAN_STATUS_COLS, FingerprintMode, PlanStatusCol, Stage

from .helpers import ALL_CHECKS, Batch, assert_sinks_equal, clone_group, fp_to, group_to, make_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CUDA = "cuda"


@dataclass
class Policy:
    """One forward of the default policy: the batch, its layers (per-forward fingerprint and seal), the reuse lens and
    a rolling-sweep slice of one-slot segments."""

    batch: Batch
    fp: Fingerprint  # PARTIAL, one rotating layer per position, with a share
    seal: Fingerprint  # ALL, every layer
    reuse_lens: torch.Tensor
    sweep_slots: torch.Tensor  # the slice's table-space slots (request 0's first prefix slots)


def make_policy(seed: int, *, bs: int, prefix: int | list[int], ext: int | list[int], halves: int, layers: int,
                row_bytes: int, share: int, swa: bool = False, device: str = CUDA) -> Policy:
    """Records written by the torch reference with the policy's fingerprints, then a few KV bytes flipped."""
    rng = random.Random(seed)
    b = make_batch(seed, bs=bs, prefix=prefix, ext=ext, halves=halves, swa=swa, corrupt=1, expect=True,
                   device=device)
    gen = torch.Generator().manual_seed(seed + 1)
    n = b.head.num_slots
    rows = [[SourceSpec(torch.randint(0, 256, (n, row_bytes), dtype=torch.uint8, generator=gen).to(device))
             for _ in range(layers)] for _ in range(halves)]
    src = FingerprintSources(rows, n)
    fp = Fingerprint(src, FingerprintMode.PARTIAL, layers, share)
    seal = Fingerprint(src, FingerprintMode.ALL)
    every = torch.arange(n, device=device)
    for h in range(halves):  # clean fingerprints of whatever each record claims (its stored position)
        for view, f in ((b.head, seal), (b.tail, fp)):
            view.records[:, h, 3] = fingerprint(src, h, every, view.records[:, h, 1].clamp(min=0), f.mode,
                                                f.layer_stride, backend="torch")
    for _ in range(3):  # bit flips anywhere in a layer's row: the seal sees them, the partial bytes sometimes
        t = rows[rng.randrange(halves)][rng.randrange(layers)].tensor
        t[rng.randrange(n), rng.randrange(row_bytes)] ^= 1 << rng.randrange(8)
    pres = b.pre.tolist()
    reuse = torch.tensor([p if rng.random() < 0.5 else 0 for p in pres], dtype=torch.int64, device=device)
    slice_len = min(pres[0], 37)
    return Policy(b, fp, seal, reuse, b.table[0, :slice_len].to(torch.int64).contiguous())


def run_policy(pol: Policy, backend: str, dev: str) -> dict[str, Any]:
    """plan (+ reuse) -> HEAD verify -> reuse verify (seal) -> sealed HEAD write -> TAIL verify (share) -> TAIL write
    -> sweep slice (TAIL + partial, HEAD + seal), on copies moved to ``dev``; returns every output."""
    b = pol.batch
    head, tail = group_to(clone_group(b.head), dev), group_to(clone_group(b.tail), dev)
    fp, seal = fp_to(pol.fp, dev), fp_to(pol.seal, dev)
    assert fp is not None and seal is not None
    t = {k: v.to(dev) for k, v in (("table", b.table), ("rpi", b.rpi), ("pre", b.pre), ("ext", b.ext),
                                   ("ids", b.ids), ("pos", b.pos), ("loc", b.loc), ("reuse", pol.reuse_lens),
                                   ("sweep", pol.sweep_slots))}
    ep = None if b.expect_prefix is None else b.expect_prefix.to(dev)
    en = None if b.expect_new is None else b.expect_new.to(dev)
    bs = b.rpi.shape[0]

    def buffers(cap: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.full((cap, NUM_PLAN_COLS), 777, dtype=torch.int64, device=dev),
                torch.full((NUM_PLAN_STATUS_COLS,), 555, dtype=torch.int64, device=dev))

    plan, status = buffers(bs)
    rplan, rstatus = buffers(bs)
    w = t["sweep"].shape[0]
    splan, sstatus = buffers(max(w, 1))
    sink = Sink.allocate(8192, dev)
    sink.step.fill_(3)
    tbl, nt = t["table"], int(b.ids.shape[0])
    plan_forward(plan, status, t["rpi"], t["pre"], t["ext"], tbl, nt, window=b.window, expect_prefix=ep,
                 expect_new=en, reuse=(rplan, rstatus, t["reuse"]), backend=backend)
    verify(head, Stage.HEAD, plan, status, tbl, sink, backend=backend)
    verify(head, Stage.TAIL, rplan, rstatus, tbl, sink, fingerprint=seal, backend=backend)
    write(head, Stage.HEAD, plan, status, tbl, t["ids"], t["pos"], t["loc"], sink, checks=ALL_CHECKS,
          fingerprint=seal, backend=backend)
    verify(tail, Stage.TAIL, plan, status, tbl, sink, fingerprint=fp, backend=backend)
    write(tail, Stage.TAIL, plan, status, tbl, t["ids"], t["pos"], t["loc"], sink, checks=ALL_CHECKS,
          fingerprint=fp, backend=backend)
    if w:
        idx = torch.arange(w, device=dev)
        prev = torch.cat([torch.full((1,), NO_SLOT, dtype=torch.int64, device=dev), t["sweep"][:-1]])
        plan_sweep(splan, sstatus, t["sweep"], idx, torch.ones_like(idx), idx, prev, backend=backend)
        verify(tail, Stage.SWEEP, splan, sstatus, t["sweep"].view(1, -1), sink, fingerprint=fp, backend=backend)
        verify(head, Stage.SWEEP, splan, sstatus, t["sweep"].view(1, -1), sink, fingerprint=seal, backend=backend)
    return {"plan": plan, "status": status, "rplan": rplan, "rstatus": rstatus, "head": head.records,
            "tail": tail.records, "sink": sink}


def assert_policy_equal(x: dict[str, Any], y: dict[str, Any], what: str) -> None:
    for p, s in (("plan", "status"), ("rplan", "rstatus")):
        assert torch.equal(x[s].cpu(), y[s].cpu()), f"{what}: {s}"
        n = int(x[s][PlanStatusCol.NUM_SEGMENTS])
        assert torch.equal(x[p][:n].cpu(), y[p][:n].cpu()), f"{what}: {p} rows"
    assert torch.equal(x["head"].cpu(), y["head"].cpu()), f"{what}: HEAD records (seal)"
    assert torch.equal(x["tail"].cpu(), y["tail"].cpu()), f"{what}: TAIL records"
    assert_sinks_equal(x["sink"], y["sink"], what)


# (bs, prefix, ext, halves, layers, row bytes, share, swa): few tokens x many layers (one token per block, rows dealt
# to warps), odd row lengths (a chunk count that is no multiple of the 4-deep load batch), > 256 tokens (the tiled
# seal), an extend crossing tiles, SWA.
CASES = [
    (1, 5, 1, 1, 13, 48, 1, False),
    (1, 300, 1, 2, 32, 2064, 2, False),
    (3, [0, 7, 33], [4, 1, 1], 2, 7, 2064, 4, False),
    (37, 64, 1, 1, 4, 2048, 1, False),
    (37, 64, 1, 2, 4, 2048, 4, False),
    (300, 20, 1, 2, 3, 112, 2, False),
    (2, [0, 40], [700, 1], 1, 2, 4096, 1, False),
    (17, 50, [1] * 16 + [9], 2, 5, 208, 2, True),
    (256, 9, 1, 1, 64, 16, 8, False),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_policy_bracket_matches_torch_and_cpu(case: int) -> None:
    bs, pre, ext, halves, layers, row_bytes, share, swa = CASES[case]
    pol = make_policy(100 + case, bs=bs, prefix=pre, ext=ext, halves=halves, layers=layers, row_bytes=row_bytes,
                      share=share, swa=swa)
    got = run_policy(pol, "cuda", CUDA)
    assert_policy_equal(got, run_policy(pol, "torch", CUDA), f"case {case} vs torch")
    assert_policy_equal(got, run_policy(pol, "cpu", "cpu"), f"case {case} vs cpu")
    tags = got["sink"].rows[:int(got["sink"].count[0])].tolist()
    assert tags, "the flipped KV bytes / record must be reported"


@pytest.mark.parametrize("seed", range(6))
def test_policy_fuzz(seed: int) -> None:
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 5, 64, 257])
    pres = [rng.randrange(0, 90) for _ in range(bs)]
    exts = [rng.choice([1, 1, 2, 5, 40]) for _ in range(bs)]
    pol = make_policy(200 + seed, bs=bs, prefix=pres, ext=exts, halves=rng.choice([1, 2]),
                      layers=rng.randint(1, 12), row_bytes=16 * rng.randint(1, 40), share=rng.choice([1, 2, 4]))
    got = run_policy(pol, "cuda", CUDA)
    assert_policy_equal(got, run_policy(pol, "torch", CUDA), f"seed {seed} vs torch")


def test_policy_bracket_graph_replay() -> None:
    """The policy bracket captured once, replayed with new KV bytes, records and reuse lens: equal to eager torch."""
    pol = make_policy(7, bs=9, prefix=40, ext=1, halves=2, layers=6, row_bytes=528, share=2)
    b = pol.batch
    static = run_policy(pol, "cuda", CUDA)  # buffers on the device; reused as the graph's static tensors
    head, tail = GroupView(static["head"], b.head.group, b.head.reserved_slots, b.head.swa_map), \
        GroupView(static["tail"], b.tail.group, b.tail.reserved_slots, b.tail.swa_map)
    sink = static["sink"]
    nt = int(b.ids.shape[0])
    w = pol.sweep_slots.shape[0]
    idx = torch.arange(w, device=CUDA)
    prev = torch.cat([torch.full((1,), NO_SLOT, dtype=torch.int64, device=CUDA), pol.sweep_slots[:-1]])
    splan = torch.zeros(w, NUM_PLAN_COLS, dtype=torch.int64, device=CUDA)
    sstatus = torch.zeros(NUM_PLAN_STATUS_COLS, dtype=torch.int64, device=CUDA)

    def bracket(backend: str, h: GroupView, t: GroupView, s: Sink, o: dict[str, torch.Tensor]) -> None:
        plan_forward(o["plan"], o["status"], b.rpi, b.pre, b.ext, b.table, nt, expect_prefix=b.expect_prefix,
                     expect_new=b.expect_new, reuse=(o["rplan"], o["rstatus"], pol.reuse_lens), backend=backend)
        verify(h, Stage.HEAD, o["plan"], o["status"], b.table, s, backend=backend)
        verify(h, Stage.TAIL, o["rplan"], o["rstatus"], b.table, s, fingerprint=pol.seal, backend=backend)
        write(h, Stage.HEAD, o["plan"], o["status"], b.table, b.ids, b.pos, b.loc, s, checks=ALL_CHECKS,
              fingerprint=pol.seal, backend=backend)
        verify(t, Stage.TAIL, o["plan"], o["status"], b.table, s, fingerprint=pol.fp, backend=backend)
        write(t, Stage.TAIL, o["plan"], o["status"], b.table, b.ids, b.pos, b.loc, s, checks=ALL_CHECKS,
              fingerprint=pol.fp, backend=backend)
        plan_sweep(o["splan"], o["sstatus"], pol.sweep_slots, idx, torch.ones_like(idx), idx, prev, backend=backend)
        table = pol.sweep_slots.view(1, -1)
        verify(t, Stage.SWEEP, o["splan"], o["sstatus"], table, s, fingerprint=pol.fp, backend=backend)
        verify(h, Stage.SWEEP, o["splan"], o["sstatus"], table, s, fingerprint=pol.seal, backend=backend)

    outs = {"plan": static["plan"], "status": static["status"], "rplan": static["rplan"], "rstatus": static["rstatus"],
            "splan": splan, "sstatus": sstatus}
    base_head, base_tail = b.head.records.clone(), b.tail.records.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        bracket("cuda", head, tail, sink, outs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bracket("cuda", head, tail, sink, outs)
    rows = pol.seal.sources.halves
    for seed in range(4):
        rng = random.Random(seed)
        head.records.copy_(base_head)
        tail.records.copy_(base_tail)
        for _ in range(seed):  # new damage in place: KV bytes of any layer, a record
            t = rows[rng.randrange(2)][rng.randrange(6)].tensor
            t[int(pol.sweep_slots[rng.randrange(w)]), rng.randrange(528)] ^= 4
        pol.reuse_lens.copy_(torch.tensor([rng.choice([0, 40]) for _ in range(9)], device=CUDA))
        for tnsr in (sink.rows, sink.count, sink.counters):
            tnsr.zero_()
        sink.step.fill_(seed)
        ref_h = GroupView(head.records.clone(), head.group, head.reserved_slots, head.swa_map)
        ref_t = GroupView(tail.records.clone(), tail.group, tail.reserved_slots, tail.swa_map)
        ref_s = Sink.allocate(sink.capacity, CUDA)
        ref_s.step.fill_(seed)
        ref_o = {k: v.clone() for k, v in outs.items()}
        bracket("torch", ref_h, ref_t, ref_s, ref_o)
        graph.replay()
        torch.cuda.synchronize()
        for k in ("status", "rstatus", "sstatus"):
            assert torch.equal(outs[k], ref_o[k]), (seed, k)
        assert torch.equal(head.records, ref_h.records), seed
        assert torch.equal(tail.records, ref_t.records), seed
        assert_sinks_equal(sink, ref_s, f"replay {seed}")
