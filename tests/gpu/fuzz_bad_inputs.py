"""Bad-input fuzz of every native op, for compute-sanitizer (memcheck, racecheck) on CUDA: python -m
tests.gpu.fuzz_bad_inputs [--device cpu] (the CPU run, in the CPU test suite, keeps it in step with the helpers it
calls)."""

from __future__ import annotations

import argparse
import random

import numpy as np
import torch
from kvcanary.demo import clean_run
from kvcanary.ops.bookkeep import bind_bookkeep
from kvcanary.ops.fingerprint import fingerprint
from kvcanary.ops.invalidate import invalidate
from kvcanary.ops.plan import derive_roll, plan_forward, plan_roll
from kvcanary.ops.scatter_tokens import scatter_tokens
from kvcanary.ops.slot_rows import slot_rows, stage_slot_rows
from kvcanary.ops.stage_batch import stage_batch
from kvcanary.ops.stage_window import stage_window
from kvcanary.ops.types import Sink, TokenPool
from kvcanary.ops.verify import verify
from kvcanary.ops.write import write, write_carries, write_workspace
from kvcanary_schema import (
    NUM_PLAN_COLS,
    NUM_PLAN_STATUS_COLS,
    RECORD_NUM_FIELDS,
    STAGE_INLINE_ROWS,
    CarryHeaderCol,
    FingerprintMode,
    PlanStatusCol,
    Stage,
    WriteCheck,
)

from . import test_cuda_ops as TO
from . import test_cuda_policy as TP
from .helpers import ALL_CHECKS, consistent_entry_offsets, fp_to, group_to, make_batch, pool_to, run_bracket


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--large", type=int, default=2)
    ap.add_argument("--runtime", type=int, default=0, help="then the demo's clean run of this many forwards (0: none)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="the device and its native backend")
    args = ap.parse_args()
    import test_verify as TV  # noqa: PLC0415
    import test_write as TW  # noqa: PLC0415

    dev = args.device  # also the backend's name
    cuda = dev == "cuda"

    def pin(t: torch.Tensor) -> torch.Tensor:  # staging the CUDA ops read in place; the CPU ops take any host memory
        return t.pin_memory() if cuda else t

    for seed in range(args.n):
        rng = random.Random(seed)
        sc = TV.make_scenario(rng)
        if seed % 2:
            TV.random_plan(rng, sc)
            if seed % 4 == 1:
                consistent_entry_offsets(sc.plan, sc.status)  # else: garbage offsets, must still stay in bounds
        sink = Sink.allocate(rng.choice([1, 8, 4096]), dev)
        verify(group_to(sc.group, dev), sc.stage, sc.plan.to(dev), sc.status.to(dev), sc.table.to(dev), sink,
               token_pool=pool_to(sc.pool, dev), fingerprint=fp_to(sc.fp, dev), backend=dev)
        case = TW.make_case(seed, halves=rng.choice([1, 2]), swa=rng.random() < 0.5, fp=rng.random() < 0.4,
                            checks=ALL_CHECKS, pool=True, bad=0.6)
        if seed % 3 == 0:  # garbage plan rows and status for write
            n = case.plan.shape[0]
            case.plan[:, rng.randrange(NUM_PLAN_COLS)] = torch.randint(-5, 50, (n,))
            case.status[0] = rng.choice([-3, n + 9, n])
        write(group_to(case.group, dev), case.stage, case.plan.to(dev), case.status.to(dev), case.table.to(dev),
              case.ids.to(dev), case.pos.to(dev), case.loc.to(dev), sink, checks=case.checks,
              token_pool=pool_to(case.pool, dev), fingerprint=fp_to(case.fp, dev), backend=dev)
        # plan with bad requests
        bs = rng.randint(0, 40)
        plan = torch.zeros(bs + 1, NUM_PLAN_COLS, dtype=torch.int64, device=dev)
        status = torch.zeros(NUM_PLAN_STATUS_COLS, dtype=torch.int64, device=dev)
        table = torch.randint(-3, 100, (5, 9), device=dev)
        reuse = (torch.zeros(bs + 1, NUM_PLAN_COLS, dtype=torch.int64, device=dev),
                 torch.zeros(NUM_PLAN_STATUS_COLS, dtype=torch.int64, device=dev),
                 torch.randint(-2, 11, (bs,), device=dev))
        plan_forward(plan, status, torch.randint(-2, 7, (bs,), device=dev), torch.randint(-2, 11, (bs,), device=dev),
                     torch.randint(-2, 11, (bs,), device=dev), table, rng.randint(0, 30), window=rng.choice([0, 3]),
                     reuse=reuse if seed % 2 else None, tick=torch.zeros(seed % 3, dtype=torch.int64, device=dev),
                     backend=dev)
        # rolling-sweep slice of a spoiled export (bad inverse entries, starts, lens, non-monotone ends)
        import test_plan_roll as TR  # noqa: PLC0415

        e, m, cursor, width = TR._random_export(rng)
        plan = torch.zeros(width + 1, NUM_PLAN_COLS, dtype=torch.int64, device=dev)
        t = {k: torch.tensor(getattr(e, k), dtype=torch.int64, device=dev) for k in
             ("slots", "starts", "lens", "ends", "firsts", "prevs", "inv")}
        plan_roll(plan, status, torch.zeros(width, dtype=torch.int64, device=dev), t["slots"], t["starts"], t["lens"],
                  t["ends"], t["firsts"], t["prevs"], t["inv"], m, cursor, backend=dev,
                  unlocked=None if e.unlocked is None else torch.tensor(e.unlocked, dtype=torch.int64, device=dev))
        slots, lens, inv, m = TO._derive_case(rng)  # inverse map and running ends of a spoiled export
        derive_roll(slots.to(dev), lens.to(dev), inv.to(dev), torch.zeros_like(lens, device=dev), m, backend=dev)
        # scatter with bad requests (distinct rows)
        pool = TokenPool(torch.zeros(6, 20, dtype=torch.int64, device=dev), torch.zeros(6, dtype=torch.int64,
                                                                                        device=dev))
        n = rng.randint(0, 6)
        rows = torch.tensor(rng.sample(range(-1, 7), n), dtype=torch.int64, device=dev)
        scatter_tokens(pool, rows, torch.randint(-2, 22, (n,), device=dev), torch.randint(-2, 25, (n,), device=dev),
                       torch.randint(0, 9, (rng.randint(0, 60),), device=dev), torch.zeros(1, dtype=torch.int64,
                                                                                         device=dev), backend=dev)
        # batch staging at random sizes, dtypes and pads (pinned staging read in place)
        bs, nt = rng.randint(0, 9), rng.randint(0, 40)
        srcs = [torch.randint(-9, 9, (bs if i < 3 else nt,), dtype=rng.choice([torch.int32, torch.int64]), device=dev)
                for i in range(6)]
        rc, tc = bs + rng.randint(0, 7), nt + rng.randint(0, 70)
        dst = [torch.zeros(n, c, dtype=torch.int64, device=dev) for n, c in ((3, rc), (5, rc), (3, tc))]
        stage_batch(srcs, pin(torch.randint(-9, 9, (5, bs + rng.randint(0, 2)))), *dst, rng.randint(bs, rc),
                    rng.randint(nt, tc), -1, backend=dev)
        # a steady decode's truth and staging (declines, bad values and steady batches; staging rows in the launch or
        # in pinned memory)
        TO._run_decode(TO._decode_case(rng, inline=seed % 2 == 0), dev, dev, pinned=cuda)
        # the post tick's mirror into pinned host memory
        tick = torch.zeros(1, dtype=torch.int64, device=dev)
        vals = torch.randint(0, 9, (rng.randint(1, 3),), device=dev)
        mirror = pin(torch.zeros(vals.shape[0] + 1, dtype=torch.int64))
        bind_bookkeep(tick, tick[:0], tick[:0], dev, vals, mirror).frozen()(tick)
        # freed-slot invalidation: ids in and outside the pool, on the device and on the host
        slots = rng.randint(0, 60)
        rec = torch.zeros(rng.randint(1, 2), slots, rng.randint(1, 2), RECORD_NUM_FIELDS, dtype=torch.int64, device=dev)
        ids = torch.randint(-9, slots + 9, (rng.randint(0, 3000),), dtype=rng.choice([torch.int32, torch.int64]))
        invalidate(rec, ids if seed % 2 else ids.to(dev), rng.randint(0, slots), dev)
        # slot-row fill: rows outside the table, segments leaving src, negative lengths and slots
        # batches on both sides of the CUDA stage_slot_rows' facts in the launch (at most STAGE_INLINE_ROWS)
        bs = rng.randint(0, 9) if seed % 2 else rng.randint(STAGE_INLINE_ROWS - 3, STAGE_INLINE_ROWS + 6)
        width = rng.randint(1, 50)
        m = rng.randint(0, 300)
        slot_rows(torch.zeros(rng.randint(1, 6), width, dtype=rng.choice([torch.int32, torch.int64]), device=dev),
                  *(torch.randint(lo, hi, (bs,), device=dev) for lo, hi in ((-3, 9), (-5, m + 5), (-5, 80))),
                  torch.randint(-9, 1 << 40, (m,), device=dev), torch.zeros(40, dtype=torch.int64, device=dev),
                  torch.randint(-9, 1 << 40, (40,), device=dev), rng.randint(1, 9), 1, backend=dev)
        # the same with its row facts staged from the host (12a): rows outside the table, negative lengths, src short
        facts_in = np.array([[rng.randint(-3, 9) for _ in range(bs)], [rng.randint(-5, 40) for _ in range(bs)],
                             [rng.randint(-5, 40) for _ in range(bs)]], dtype=np.int64).reshape(3, bs)
        staging = pin(torch.zeros(5, bs + rng.randint(0, 3), dtype=torch.int64))
        stage_slot_rows(torch.zeros(rng.randint(1, 6), width, dtype=rng.choice([torch.int32, torch.int64]), device=dev),
                        facts_in, staging, torch.zeros(staging.shape, dtype=torch.int64, device=dev),
                        torch.randint(-9, 1 << 40, (m,), device=dev), torch.zeros(40, dtype=torch.int64, device=dev),
                        torch.randint(-9, 1 << 40, (40,), device=dev), rng.randint(1, 9), 1, backend=dev)
        # window staging: counts below 0 and past the ring, the count and reset inside the head
        cap, cols = rng.randint(0, 40), rng.randint(1, 8)
        arena = torch.randint(-9, 9, (6 + cap * cols,), device=dev)
        arena[2] = rng.randint(-5, cap + 5)
        stage_window(arena[:6], arena[2:3], arena[6:].view(cap, cols), arena[2:6],
                     pin(torch.zeros(7 + cap * cols, dtype=torch.int64)), seed, backend=dev)
        if sc.fp is not None:
            src = fp_to(sc.fp, dev)
            assert src is not None
            fingerprint(src.sources, 0, torch.randint(-5, 60, (50,), device=dev),
                        torch.randint(-5, 60, (50,), device=dev), FingerprintMode.ALL, backend=dev)
    for k in range(args.large):
        b = make_batch(900 + k, bs=3, prefix=[0, 700, 1500], ext=[1100, 5, 2300], swa=k % 2 == 1, window=64,
                       fp_mode=FingerprintMode.ALL, fp_bytes=128, corrupt=20, device=dev)
        b.loc[::50] = -7
        b.pos[::77] = -1
        run_bracket(b, dev, ring=16)
        # the look-back writes (several tiles per write) on the same batch, then on garbage plan rows
        ws = (write_workspace(4000, dev), write_workspace(4000, dev))
        run_bracket(b, dev, ring=16, workspaces=ws)
        # kept carries, then an armed header over garbage rows (each row is checked against the plan before use)
        carries = write_carries(4000, dev)
        got = run_bracket(b, dev, ring=16, workspaces=ws, carries=carries)
        carries.copy_(torch.randint(-9, 5000, tuple(carries.shape), dtype=torch.int64, device=dev))
        carries[0] = 0
        carries[0, CarryHeaderCol.ARMED], carries[0, CarryHeaderCol.STEP] = 1, int(got["sink"].step[0])
        carries[0, CarryHeaderCol.TOTAL] = carries.shape[0] - 1
        sink = Sink.allocate(8, dev)
        sink.step.copy_(got["sink"].step)
        write(b.tail, Stage.TAIL, got["plan"], got["status"], b.table, b.ids, b.pos, b.loc, sink,
              checks=ALL_CHECKS | int(WriteCheck.REUSE_CARRIES), carries=carries, backend=dev)
        junk = torch.randint(-9, 5000, (3, NUM_PLAN_COLS), dtype=torch.int64, device=dev)
        junk_status = torch.zeros(NUM_PLAN_STATUS_COLS, dtype=torch.int64, device=dev)
        junk_status[PlanStatusCol.NUM_SEGMENTS] = 3
        write(b.head, Stage.HEAD, junk, junk_status, b.table, b.ids, b.pos, b.loc, Sink.allocate(8, dev),
              checks=ALL_CHECKS, workspace=ws[0], backend=dev)
        # the default policy's kernels: seal of few tokens x many layers, reuse plan, share, one-slot sweep segments
        pol = TP.make_policy(950 + k, bs=5, prefix=[0, 3, 60, 9, 200], ext=[4, 1, 1, 1, 1], halves=2, layers=9,
                             row_bytes=208, share=2, swa=k % 2 == 1, device=dev)
        pol.batch.loc[::3] = -7
        TP.run_policy(pol, dev, dev)
    if args.runtime:  # the runtime's device program: stage sequences cut to each forward's shape, new requests, sweeps
        clean_run(0, dev, dev, args.runtime, quiet=True)
    if cuda:
        torch.cuda.synchronize()
    print("fuzz done", args.n, args.large)


if __name__ == "__main__":
    main()
