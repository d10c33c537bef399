"""CPU benchmark (python -m bench.bench_cpu) and its baseline: per-entry Python loops of write and verify."""

from __future__ import annotations

from typing import Any

import torch
from kvcanary.ops import hashes as H
from kvcanary.ops.types import Fingerprint, GroupView, Sink, TokenPool
from kvcanary_schema import (
    FP_GAMMA,
    FP_POS_SEED,
    FP_SEED,
    NO_SLOT,
    NUM_VIOLATION_COLS,
    PARTIAL_READ_BYTES,
    SKIP_TOKEN,
    TOKEN_LIMIT,
    CounterCol,
    FailReason,
    FingerprintMode,
    FpSourceCol,
    PlanCol,
    PlanFlag,
    PlanStatusCol,
    Stage,
    ViolationCol,
    WriteCheck,
)

U64 = H.U64
OK, INPUT_ERROR, EVICTED, RESERVED = 0, 1, 2, 3


def _ok(v: int) -> bool:
    return 0 <= v < TOKEN_LIMIT


class _Fp:
    """Fingerprints with Python ints over each source's bytes (pre-extracted once)."""

    def __init__(self, fp: Fingerprint) -> None:
        self.mode, self.stride = fp.mode, fp.layer_stride
        self.src: list[list[tuple[bytes, int, int, int, int]]] = []
        for h, rows in enumerate(fp.sources.rows):
            meta = fp.sources.table[h].tolist()
            self.src.append([(r.contiguous().numpy().tobytes(), r.shape[1], m[FpSourceCol.PAGE_SIZE],
                              m[FpSourceCol.BYTES_PER_TOKEN], m[FpSourceCol.READ_BYTES])
                             for r, m in zip(rows, meta, strict=True)])

    def __call__(self, half: int, slot: int, position: int) -> int:
        acc = 0
        for j, (raw, row_bytes, page, bpt, read) in enumerate(self.src[half]):
            if (j + position) % self.stride:
                continue
            rb = PARTIAL_READ_BYTES if self.mode == FingerprintMode.PARTIAL else read
            off = (slot // page) * row_bytes + (slot % page) * bpt
            for i in range(rb // 8):
                key = (FP_SEED + ((j << 32) + i) * FP_GAMMA) & U64
                acc = (acc + H.splitmix64_int(int.from_bytes(raw[off + 8 * i: off + 8 * i + 8], "little") ^ key)) & U64
        return H.splitmix64_int(acc ^ H.splitmix64_int(position ^ FP_POS_SEED))


class _Group:
    def __init__(self, group: GroupView) -> None:
        self.n = group.num_slots
        self.reserved = group.reserved_slots
        self.swa = None if group.swa_map is None else group.swa_map.tolist()

    def resolve(self, t: int) -> tuple[int, int]:
        if self.swa is None:
            if t < 0 or t >= self.n:
                return INPUT_ERROR, t
        else:
            if t < 0 or t >= len(self.swa):
                return INPUT_ERROR, t
            m = self.swa[t]
            if m < 0:
                return EVICTED, m
            if m >= self.n:
                return INPUT_ERROR, m
            t = m
        return (RESERVED if t < self.reserved else OK), t


def _row(tag: int, reasons: int, seg: list[int], **cols: int) -> list[int]:
    r = [0] * NUM_VIOLATION_COLS
    r[ViolationCol.TAG], r[ViolationCol.REASONS] = tag, reasons
    r[ViolationCol.BATCH_INDEX], r[ViolationCol.REQ_ROW] = seg[PlanCol.BATCH_INDEX], seg[PlanCol.ROW]
    r[ViolationCol.EXPECTED_TOKEN] = SKIP_TOKEN
    for name, v in cols.items():
        r[ViolationCol[name]] = v
    return r


def _finish(sink: Sink, counters: list[list[int]], rows: list[list[int]]) -> None:
    step = int(sink.step[0])
    k0 = int(sink.count[0])
    for i, r in enumerate(rows):
        r[ViolationCol.STEP] = step
        counters[r[ViolationCol.TAG]][CounterCol.VIOLATIONS] += 1
        if k0 + i < sink.capacity:
            sink.rows[k0 + i] = torch.tensor(r, dtype=torch.int64)
    sink.count += len(rows)
    sink.counters.copy_(torch.tensor(counters, dtype=torch.int64))


def _link(rec: list[int]) -> int | None:
    if not (_ok(rec[0]) and _ok(rec[1])):
        return None
    return H.chain_step_int(H.to_u64(rec[2]), rec[0], rec[1])


def _pool_token(pool: Any, row: int, p: int) -> int:
    if pool is None:
        return SKIP_TOKEN
    tokens, lens, off = pool
    q = p + off
    if not 0 <= row < len(tokens) or not 0 <= q < min(lens[row], len(tokens[row])):
        return SKIP_TOKEN
    return int(tokens[row][q])


def write_loop(group: GroupView, stage: Stage, plan: torch.Tensor, status: torch.Tensor, input_ids: torch.Tensor,
               positions: torch.Tensor, out_cache_loc: torch.Tensor, sink: Sink, *, checks: int = 0,
               token_pool: TokenPool | None = None, fingerprint: Fingerprint | None = None) -> None:
    """docs/ops-contract.md 5, one entry at a time with Python ints (same effects as ``ops.write.write``)."""
    recs = group.records.tolist()
    g = _Group(group)
    tags = group.tags(stage)
    counters = sink.counters.tolist()
    rows: list[list[int]] = []
    fpf = None if fingerprint is None else _Fp(fingerprint)
    pool = None if token_pool is None else (token_pool.tokens.tolist(), token_pool.lens.tolist(), token_pool.offset)
    ids, pos, loc = input_ids.tolist(), positions.tolist(), out_cache_loc.tolist()
    T = len(ids)
    for tag in tags:
        counters[tag][CounterCol.WRITE_RUNS] += 1
    nseg = max(0, min(int(status[PlanStatusCol.NUM_SEGMENTS]), plan.shape[0]))
    for seg in plan[:nseg].tolist():
        wb, wl, pre = seg[PlanCol.WRITE_BEGIN], seg[PlanCol.WRITE_LEN], seg[PlanCol.PREFIX_LEN]
        if wl == 0:
            continue
        if not (wb >= 0 and wl >= 0 and wb + wl <= T):
            for tag in tags:
                rows.append(_row(tag, FailReason.INPUT_ERROR, seg, SLOT=NO_SLOT, POSITION=pre))
                counters[tag][CounterCol.INPUT_ERRORS] += 1
            continue
        for h, tag in enumerate(tags):
            if seg[PlanCol.FLAGS] & PlanFlag.SEED_IS_HEAD:
                hv, prev_pos = H.CHAIN_H0, -1
            else:
                kind, s0 = g.resolve(seg[PlanCol.SEED_SLOT])
                link = _link(recs[s0][h]) if kind == OK else None
                if link is None:
                    rows.append(_row(tag, FailReason.INPUT_ERROR, seg, SLOT=seg[PlanCol.SEED_SLOT], POSITION=pre - 1))
                    counters[tag][CounterCol.INPUT_ERRORS] += 1
                    continue
                hv, prev_pos = link, recs[s0][h][1]
            last: tuple[int, int, int, int] | None = None
            for j in range(wl):
                t, p, lc = ids[wb + j], pos[wb + j], loc[wb + j]
                if lc < 0:
                    continue
                kind, s = g.resolve(lc)
                if kind == EVICTED:
                    counters[tag][CounterCol.SKIPPED] += 1
                    continue
                if kind == INPUT_ERROR or not (_ok(t) and _ok(p)):
                    rows.append(_row(tag, FailReason.INPUT_ERROR, seg, SLOT=s, POSITION=pre + j, STORED_POSITION=p,
                                     STORED_TOKEN=t))
                    counters[tag][CounterCol.INPUT_ERRORS] += 1
                    continue
                reasons, want_tok = 0, SKIP_TOKEN
                if checks & WriteCheck.CHAIN_POSITION and p != prev_pos + 1:
                    reasons |= FailReason.WRITE_POSITION
                if checks & WriteCheck.INPUTS:
                    if p != pre + j:
                        reasons |= FailReason.WRITE_POSITION
                    want_tok = _pool_token(pool, seg[PlanCol.ROW], p)
                    if want_tok != SKIP_TOKEN and t != want_tok:
                        reasons |= FailReason.WRITE_TOKEN
                fpv = 0 if fpf is None else fpf(h, s, p)
                recs[s][h] = [t, p, H.to_i64(hv), H.to_i64(fpv)]
                counters[tag][CounterCol.ENTRIES_WRITTEN] += 1
                if reasons:
                    rows.append(_row(tag, int(reasons), seg, SLOT=s, POSITION=pre + j, STORED_POSITION=p,
                                     STORED_TOKEN=t, EXPECTED_TOKEN=want_tok, STORED_HASH=H.to_i64(hv),
                                     STORED_FP=H.to_i64(fpv)))
                hv, prev_pos, last = H.chain_step_int(hv, t, p), p, (s, j, p, t)
            if seg[PlanCol.FLAGS] & PlanFlag.EXPECT_NEW and last is not None and \
                    H.to_i64(hv) != seg[PlanCol.EXPECT_NEW]:
                s, j, p, t = last
                rows.append(_row(tag, FailReason.WRITE_TOKEN, seg, SLOT=s, POSITION=pre + j, STORED_POSITION=p,
                                 STORED_TOKEN=t, STORED_HASH=H.to_i64(hv), EXPECTED_HASH=seg[PlanCol.EXPECT_NEW]))
    group.records.copy_(torch.tensor(recs, dtype=torch.int64).view_as(group.records))
    _finish(sink, counters, rows)
