"""Write op (docs/ops-contract.md 5): the new tokens' records, one chain per segment; torch reference + native."""

from __future__ import annotations

import torch
from kvcanary_schema import (
    CHAIN_BASE,
    NO_SLOT,
    SKIP_TOKEN,
    CounterCol,
    FailReason,
    FingerprintMode,
    PlanCol,
    PlanFlag,
    PlanStatusCol,
    RecordField,
    Stage,
    ViolationCol,
    WriteCheck,
)

from kvcanary import _native
from kvcanary.errors import CanaryInputError
from kvcanary.ops import hashes as H
from kvcanary.ops.fingerprint import check_fingerprint, fingerprint_torch
from kvcanary.ops.plan import check_plan_buffers, empty_i64
from kvcanary.ops.types import Fingerprint, GroupView, Sink, TokenPool, check_backend, check_tensor
from kvcanary.ops.verify import _append, _rows, record_link, resolve_slots

# Slot resolution outcomes (csrc/core/resolve.cuh SlotStatus).
_OK, _INPUT_ERROR, _EVICTED, _RESERVED = 0, 1, 2, 3
_ALL_CHECKS = int(WriteCheck.CHAIN_POSITION | WriteCheck.INPUTS)
_CHAIN_BASE_INV = pow(CHAIN_BASE, -1, 1 << 64)


def write(group: GroupView, stage: Stage, plan: torch.Tensor, status: torch.Tensor, table: torch.Tensor,
          input_ids: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor, sink: Sink, *,
          checks: int = 0, token_pool: TokenPool | None = None, fingerprint: Fingerprint | None = None,
          backend: str = "torch") -> None:
    """Write the records of every planned segment's new tokens (both halves of one HEAD/TAIL stage) into ``group``.

    ``input_ids``, ``positions`` and ``out_cache_loc`` are the batch's flat int64 ``[num_tokens]`` tensors
    (``out_cache_loc`` in table space, negative = skipped); ``checks`` holds WriteCheck bits. Fingerprints are
    TAIL-only. Bad values inside tensors become counted INPUT_ERROR rows in ``sink``.
    """
    if not isinstance(group, GroupView):
        raise CanaryInputError(f"group must be a GroupView, got {type(group).__name__}")
    if stage not in (Stage.HEAD, Stage.TAIL):
        raise CanaryInputError(f"write stage must be Stage.HEAD or Stage.TAIL, got {stage!r}")
    device = group.records.device
    p, s = check_plan_buffers(plan, status, device)
    tbl = check_tensor(table, "table", dtype=(torch.int32, torch.int64), ndim=2, device=device)
    ids = check_tensor(input_ids, "input_ids", ndim=1, device=device)
    pos = check_tensor(positions, "positions", ndim=1, device=device, shape=(ids.shape[0],))
    loc = check_tensor(out_cache_loc, "out_cache_loc", ndim=1, device=device, shape=(ids.shape[0],))
    if not isinstance(sink, Sink):
        raise CanaryInputError(f"sink must be a Sink, got {type(sink).__name__}")
    sink.validate(device)
    if isinstance(checks, bool) or not isinstance(checks, int) or checks & ~_ALL_CHECKS or checks < 0:
        raise CanaryInputError(f"checks must be WriteCheck bits, got {checks!r}")
    if token_pool is not None:
        if not isinstance(token_pool, TokenPool):
            raise CanaryInputError(f"token_pool must be a TokenPool, got {type(token_pool).__name__}")
        check_tensor(token_pool.tokens, "token pool", ndim=2, device=device)
    check_fingerprint(fingerprint, group, stage)
    tags = group.tags(stage)
    b = check_backend(backend, device)
    if b == "torch":
        _write_torch(group, tags, p, s, ids, pos, loc, sink, checks, token_pool, fingerprint)
        return
    e = empty_i64(device)
    _native.module(b).write(
        group.records, e if group.swa_map is None else group.swa_map, int(group.swa_map is not None),
        group.reserved_slots, tags[0], tags[1] if len(tags) > 1 else -1,
        p, s, tbl, ids, pos, loc, sink.rows, sink.count, sink.counters, sink.step, checks,
        e if token_pool is None else token_pool.tokens, e if token_pool is None else token_pool.lens,
        int(token_pool is not None), 0 if token_pool is None else token_pool.offset,
        e if fingerprint is None else fingerprint.sources.table,
        int(FingerprintMode.NONE) if fingerprint is None else int(fingerprint.mode),
        1 if fingerprint is None else fingerprint.layer_stride)


# ---- torch reference -------------------------------------------------------------------------------------------

def powers(base: int, n: int, device: torch.device) -> torch.Tensor:
    """int64 ``[base^0, ..., base^(n-1)]`` mod 2^64 (built by doubling: log2(n) wrapping multiplies)."""
    out = torch.ones(max(n, 1), dtype=torch.int64, device=device)
    k = 1
    while k < n:
        m = min(k, n - k)
        out[k:k + m] = out[:m] * H.to_i64(pow(base, k, 1 << 64))
        k += m
    return out[:n]


def _excl_cumsum(x: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sum with the total appended: length len(x) + 1 (int64 wrapping)."""
    return torch.cat([torch.zeros(1, dtype=torch.int64, device=x.device), torch.cumsum(x, 0)])


def _bit(mask: torch.Tensor, reason: FailReason) -> torch.Tensor:
    return mask.to(torch.int64) * int(reason)


def _write_torch(group: GroupView, tags: list[int], plan: torch.Tensor, status: torch.Tensor, ids: torch.Tensor,
                 pos: torch.Tensor, loc: torch.Tensor, sink: Sink, checks: int, pool: TokenPool | None,
                 fp: Fingerprint | None) -> None:
    dev = group.records.device
    num_tokens = ids.shape[0]
    for tag in tags:
        sink.counters[tag, CounterCol.WRITE_RUNS] += 1
    nseg = int(torch.clamp(status[PlanStatusCol.NUM_SEGMENTS], 0, plan.shape[0]).item())
    seg = plan[:nseg]
    seg = seg[seg[:, PlanCol.WRITE_LEN] != 0]
    wb, wl = seg[:, PlanCol.WRITE_BEGIN], seg[:, PlanCol.WRITE_LEN]
    range_ok = (wb >= 0) & (wl >= 0) & (wb <= num_tokens) & (wl <= num_tokens - wb)
    out: list[torch.Tensor] = []

    def rows_for(tag: int, reasons: torch.Tensor | int, g: torch.Tensor) -> torch.Tensor:
        r = _rows(g.shape[0], dev)
        r[:, ViolationCol.TAG] = tag
        r[:, ViolationCol.REASONS] = reasons
        r[:, ViolationCol.BATCH_INDEX] = g[:, PlanCol.BATCH_INDEX]
        r[:, ViolationCol.REQ_ROW] = g[:, PlanCol.ROW]
        out.append(r)
        return r

    bad = seg[~range_ok]
    for tag in tags:  # write_emit_range_error
        r = rows_for(tag, int(FailReason.INPUT_ERROR), bad)
        r[:, ViolationCol.SLOT] = NO_SLOT
        r[:, ViolationCol.POSITION] = bad[:, PlanCol.PREFIX_LEN]
        sink.counters[tag, CounterCol.INPUT_ERRORS] += bad.shape[0]

    good = seg[range_ok]
    wb, wl = good[:, PlanCol.WRITE_BEGIN], good[:, PlanCol.WRITE_LEN]
    flags = good[:, PlanCol.FLAGS]
    # Seeds [G, H] (write_seed).
    seed_head = (flags & int(PlanFlag.SEED_IS_HEAD)) != 0
    s_out, s_slot = resolve_slots(group, good[:, PlanCol.SEED_SLOT])
    s_res = s_out == _OK
    seed_rec = group.records[torch.where(s_res, s_slot, torch.zeros_like(s_slot))] if group.num_slots else \
        torch.zeros(good.shape[0], group.halves, group.records.shape[2], dtype=torch.int64, device=dev)
    seed_ok, seed_h, seed_prev = [], [], []
    for h in range(group.halves):
        has_link, link = record_link(seed_rec[:, h])
        seed_ok.append(seed_head | (~seed_head & s_res & has_link))
        seed_h.append(torch.where(seed_head, torch.full_like(link, H.chain_h0()), link))
        seed_prev.append(torch.where(seed_head, torch.full_like(link, -1), seed_rec[:, h, RecordField.POSITION]))

    # Entries (write_entry_load): E = sum of WRITE_LEN over the good segments.
    seg_start = _excl_cumsum(wl)
    sid = torch.repeat_interleave(torch.arange(good.shape[0], device=dev), wl)
    e_count = sid.shape[0]
    ar = torch.arange(e_count, device=dev)
    e0 = seg_start[sid]
    j = ar - e0
    k = wb[sid] + j
    t, p, lc = ids[k], pos[k], loc[k]
    gs = good[sid]
    pad = lc < 0
    outcome, slot = resolve_slots(group, lc)
    slot_err = ~pad & (outcome == _INPUT_ERROR)
    evicted = ~pad & (outcome == _EVICTED)
    placed = ~pad & ((outcome == _OK) | (outcome == _RESERVED))
    bad_val = placed & ~(H.chain_value_ok(t) & H.chain_value_ok(p))
    active = placed & ~bad_val
    expected_pos = gs[:, PlanCol.PREFIX_LEN] + j

    # Exclusive affine scan per segment via prefix sums: with C = number of active entries before i (global) and
    # S = sum over earlier active m of g_m * B^-(C_m + 1), h_before(i) = B^C_i * (B^-C_e0 * seed + S_i - S_e0).
    act64 = active.to(torch.int64)
    cx = _excl_cumsum(act64)
    pw = powers(CHAIN_BASE, e_count + 1, dev)
    ipw = powers(_CHAIN_BASE_INV, e_count + 2, dev)
    g = H.chain_g(torch.where(active, t, torch.zeros_like(t)), torch.where(active, p, torch.zeros_like(p)))
    sx = _excl_cumsum(torch.where(active, g * ipw[cx[:-1] + 1], torch.zeros_like(g)))
    c_i, s_i = cx[:-1], sx[:-1]
    seg_end = seg_start[1:]
    # Index of the last active entry at or before i (cummax), then the exclusive one.
    last_incl = torch.cummax(torch.where(active, ar, torch.full_like(ar, -1)), 0).values if e_count else ar
    last_excl = torch.cat([torch.full((1,), -1, dtype=torch.int64, device=dev), last_incl[:-1]])[:e_count]
    has_prev = last_excl >= e0
    seg_last = last_incl[seg_end - 1] if e_count else seg_end
    seg_wrote = seg_last >= seg_start[:-1]

    pool_tok = torch.full_like(t, SKIP_TOKEN)
    if pool is not None and checks & WriteCheck.INPUTS:
        nr, nc = pool.tokens.shape
        prow = gs[:, PlanCol.ROW]
        q = p + pool.offset
        in_pool = (prow >= 0) & (prow < nr) & (q >= 0) & (q < nc)
        prc = torch.clamp(prow, 0, max(nr - 1, 0))
        qc = torch.clamp(q, 0, max(nc - 1, 0))
        if nr and nc:
            in_pool &= q < pool.lens[prc]
            pool_tok = torch.where(in_pool, pool.tokens[prc, qc], pool_tok)

    for h, tag in enumerate(tags):
        live = seed_ok[h][sid]
        # Seed error rows.
        bad_seed = good[~seed_ok[h]]
        r = rows_for(tag, int(FailReason.INPUT_ERROR), bad_seed)
        r[:, ViolationCol.SLOT] = bad_seed[:, PlanCol.SEED_SLOT]
        r[:, ViolationCol.POSITION] = bad_seed[:, PlanCol.PREFIX_LEN] - 1
        sink.counters[tag, CounterCol.INPUT_ERRORS] += bad_seed.shape[0]
        # Entry input errors.
        err = live & (slot_err | bad_val)
        r = rows_for(tag, int(FailReason.INPUT_ERROR), gs[err])
        r[:, ViolationCol.SLOT] = slot[err]
        r[:, ViolationCol.POSITION] = expected_pos[err]
        r[:, ViolationCol.STORED_POSITION] = p[err]
        r[:, ViolationCol.STORED_TOKEN] = t[err]
        sink.counters[tag, CounterCol.INPUT_ERRORS] += err.sum()
        sink.counters[tag, CounterCol.SKIPPED] += (live & evicted).sum()
        # Written entries.
        w = live & active
        sh = seed_h[h][sid]
        h_before = pw[c_i] * (ipw[cx[e0]] * sh + s_i - sx[e0])
        prev_pos = torch.where(has_prev, p[torch.clamp(last_excl, min=0)], seed_prev[h][sid])
        reasons = torch.zeros_like(t)
        if checks & WriteCheck.CHAIN_POSITION:
            reasons |= _bit(p != prev_pos + 1, FailReason.WRITE_POSITION)
        if checks & WriteCheck.INPUTS:
            reasons |= _bit(p != expected_pos, FailReason.WRITE_POSITION)
            reasons |= _bit((pool_tok != SKIP_TOKEN) & (t != pool_tok), FailReason.WRITE_TOKEN)
        ws, wp = slot[w], p[w]
        fpv = torch.zeros_like(ws) if fp is None else fingerprint_torch(fp.sources, h, ws, wp, fp.mode,
                                                                         fp.layer_stride)
        group.records[ws, h] = torch.stack([t[w], wp, h_before[w], fpv], 1)
        sink.counters[tag, CounterCol.ENTRIES_WRITTEN] += w.sum()
        hit = reasons[w] != 0
        r = rows_for(tag, reasons[w][hit], gs[w][hit])
        r[:, ViolationCol.SLOT] = ws[hit]
        r[:, ViolationCol.POSITION] = expected_pos[w][hit]
        r[:, ViolationCol.STORED_POSITION] = wp[hit]
        r[:, ViolationCol.STORED_TOKEN] = t[w][hit]
        r[:, ViolationCol.EXPECTED_TOKEN] = pool_tok[w][hit]
        r[:, ViolationCol.STORED_HASH] = h_before[w][hit]
        r[:, ViolationCol.STORED_FP] = fpv[hit]
        # EXPECT_NEW boundary (write_expect_new).
        st = seg_start[:-1]
        h_end = pw[cx[seg_end]] * (ipw[cx[st]] * seed_h[h] + sx[seg_end] - sx[st])
        want = good[:, PlanCol.EXPECT_NEW]
        miss = seed_ok[h] & seg_wrote & ((flags & int(PlanFlag.EXPECT_NEW)) != 0) & (h_end != want)
        li = torch.clamp(seg_last, min=0)[miss]
        r = rows_for(tag, int(FailReason.WRITE_TOKEN), good[miss])
        r[:, ViolationCol.SLOT] = slot[li]
        r[:, ViolationCol.POSITION] = expected_pos[li]
        r[:, ViolationCol.STORED_POSITION] = p[li]
        r[:, ViolationCol.STORED_TOKEN] = t[li]
        r[:, ViolationCol.STORED_HASH] = h_end[miss]
        r[:, ViolationCol.EXPECTED_HASH] = want[miss]
    if out:
        _append(sink, torch.cat(out))
