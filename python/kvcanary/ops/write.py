"""Write op (docs/ops-contract.md 5): the new tokens' records, one chain per segment; torch reference + native."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from kvcanary_schema import (
    CHAIN_BASE,
    NO_SLOT,
    NUM_CARRY_COLS,
    NUM_PLAN_COLS,
    NUM_PLAN_STATUS_COLS,
    SKIP_TOKEN,
    CounterCol,
    FailReason,
    FingerprintMode,
    PlanCol,
    PlanFlag,
    PlanStatusCol,
    RecordField,
    ShapedArg,
    Stage,
    ViolationCol,
    WriteCheck,
)

from kvcanary import _native
from kvcanary.errors import CanaryInputError
from kvcanary.ops import hashes as H
from kvcanary.ops.bound import BoundOp, Shaped
from kvcanary.ops.fingerprint import check_fingerprint, fingerprint_torch
from kvcanary.ops.plan import check_table_page, empty_i64
from kvcanary.ops.shared import append_rows, record_link, resolve_slots, table_slots, violation_rows
from kvcanary.ops.types import Fingerprint, GroupView, Sink, TokenPool, check_backend, check_tensor

# Slot resolution outcomes (csrc/core/resolve.cuh SlotStatus).
OK, INPUT_ERROR, EVICTED, RESERVED = 0, 1, 2, 3
_ALL_CHECKS = sum(int(c) for c in WriteCheck)
_CARRY_BITS = int(WriteCheck.RECORD_CARRIES | WriteCheck.REUSE_CARRIES)
_CHAIN_BASE_INV = pow(CHAIN_BASE, -1, 1 << 64)


def write(group: GroupView, stage: Stage, plan: torch.Tensor, status: torch.Tensor, table: torch.Tensor,
          input_ids: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor, sink: Sink, *,
          checks: int = 0, token_pool: TokenPool | None = None, fingerprint: Fingerprint | None = None,
          table_page: int = 1, workspace: torch.Tensor | None = None, carries: torch.Tensor | None = None,
          backend: str = "torch") -> None:
    """Write the records of every planned segment's new tokens (both halves of one HEAD/TAIL stage) into ``group``.

    ``input_ids``, ``positions`` and ``out_cache_loc`` are the batch's flat int64 ``[num_tokens]`` tensors
    (``out_cache_loc`` in table space, negative = skipped); ``checks`` holds WriteCheck bits (STRUCTURAL compares
    ``out_cache_loc`` with ``table``, a block table when ``table_page`` > 1 as in
    :func:`kvcanary.ops.plan.plan_forward`). A HEAD write takes a fingerprint only when it runs after the forward (the
    seal). Bad values inside tensors become counted INPUT_ERROR rows in ``sink``. ``workspace`` (from
    :func:`write_workspace`, this op's own) lets the CUDA kernel scan long writes in small tiles (a look-back over the
    earlier tiles' aggregates); results are the same without it. ``carries`` (from :func:`write_carries`, shared by
    a forward's HEAD and TAIL writes) holds the chain carries a write with ``checks & RECORD_CARRIES`` keeps for the
    next write with ``checks & REUSE_CARRIES`` of the same step and inputs (CUDA: no scan there).
    """
    bind_write(group, stage, plan, status, table, input_ids, positions, out_cache_loc, sink, checks=checks,
               token_pool=token_pool, fingerprint=fingerprint, table_page=table_page, workspace=workspace,
               carries=carries, backend=backend)(table)


def write_workspace(max_tokens: int, device: torch.device | str) -> torch.Tensor:
    """A zeroed write workspace for writes of up to ``max_tokens`` tokens on ``device`` (docs/ops-contract.md 5): one
    per write op (two ops never share one), allocated once; 0-element where the backend needs none (CPU)."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
        raise CanaryInputError(f"max_tokens must be an int >= 0, got {max_tokens!r}")
    device = torch.device(device)
    if device.type != "cuda":
        return torch.zeros(0, dtype=torch.int64, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    size = int(_native.module("cuda").write_workspace_size(max_tokens, index))
    return torch.zeros(size, dtype=torch.int64, device=device)


def write_carries(max_tokens: int, device: torch.device | str) -> torch.Tensor:
    """Zeroed (not armed) carries for the writes of up to ``max_tokens`` tokens on ``device``: the header row and one
    row per write entry (docs/ops-contract.md 5), shared by one HEAD write and the TAIL write after it."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
        raise CanaryInputError(f"max_tokens must be an int >= 0, got {max_tokens!r}")
    return torch.zeros(1 + max_tokens, NUM_CARRY_COLS, dtype=torch.int64, device=torch.device(device))


def takes_carries(seal: Fingerprint | None, tail_fingerprint: Fingerprint | None) -> bool:
    """Whether a forward's TAIL write can take the chain carries its HEAD write keeps (docs/ops-contract.md 5): the
    HEAD write runs before the forward (no seal, which may run beside the TAIL write) and the TAIL write's fingerprint
    is not ALL (an ALL write scans)."""
    return seal is None and (tail_fingerprint is None or tail_fingerprint.mode != FingerprintMode.ALL)


@dataclass(frozen=True)
class WriteTarget:
    """Everything of a write but the batch's plan rows and tokens, checked once (:func:`write_target`): the records,
    status, sink, options and the slot table's contract. Every batch shape an engine binds shares it."""

    fn: Callable[..., Any]
    before: tuple[Any, ...]  # the arguments before the plan
    status: Any
    after: tuple[Any, ...]  # the arguments after the tokens
    native: bool
    device: torch.device

    def bind(self, plan: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
             out_cache_loc: torch.Tensor) -> BoundOp:
        """The write of one batch shape: its plan rows and token tensors checked, a call taking the slot table."""
        p = check_tensor(plan, "plan", ndim=2, device=self.device, shape=(None, NUM_PLAN_COLS))
        ids = check_tensor(input_ids, "input_ids", ndim=1, device=self.device)
        pos = check_tensor(positions, "positions", ndim=1, device=self.device, shape=(ids.shape[0],))
        loc = check_tensor(out_cache_loc, "out_cache_loc", ndim=1, device=self.device, shape=(ids.shape[0],))
        # the plan's rows and the tokens follow the batch (BoundOp)
        sp, sids, spos, sloc = Shaped(p, ShapedArg.PLAN_ROWS), *(Shaped(t, ShapedArg.TOKENS) for t in (ids, pos, loc))
        if self.native:
            return BoundOp.of(self.fn, (*self.before, sp, self.status), (sids, spos, sloc, *self.after), native=True)
        page, *rest = self.after
        return BoundOp.of(self.fn, (*self.before, sp, self.status), (page, sids, spos, sloc, *rest))

    def frozen(self) -> WriteTarget:
        """Native targets: their torch tensors pre-converted once (see :meth:`BoundOp.frozen`)."""
        if not self.native:
            return self
        conv = BoundOp(self.fn, (*self.before, self.status), self.after, True).frozen()
        return replace(self, before=conv.before[:-1], status=conv.before[-1], after=conv.after)


def write_target(group: GroupView, stage: Stage, status: torch.Tensor, table: torch.Tensor, sink: Sink, *,
                 checks: int = 0, token_pool: TokenPool | None = None, fingerprint: Fingerprint | None = None,
                 table_page: int = 1, workspace: torch.Tensor | None = None, carries: torch.Tensor | None = None,
                 backend: str = "torch") -> WriteTarget:
    """:func:`write`'s arguments but the plan rows and the tokens, checked once (``table`` stands for the tables the
    bound calls will take: see :class:`BoundOp`)."""
    if not isinstance(group, GroupView):
        raise CanaryInputError(f"group must be a GroupView, got {type(group).__name__}")
    if stage not in (Stage.HEAD, Stage.TAIL):
        raise CanaryInputError(f"write stage must be Stage.HEAD or Stage.TAIL, got {stage!r}")
    device = group.records.device
    s = check_tensor(status, "status", ndim=1, device=device, shape=(NUM_PLAN_STATUS_COLS,))
    tbl = check_tensor(table, "table", dtype=(torch.int32, torch.int64), ndim=2, device=device)
    page = check_table_page(tbl, table_page)
    if not isinstance(sink, Sink):
        raise CanaryInputError(f"sink must be a Sink, got {type(sink).__name__}")
    sink.validate(device)
    if isinstance(checks, bool) or not isinstance(checks, int) or checks & ~_ALL_CHECKS or checks < 0:
        raise CanaryInputError(f"checks must be WriteCheck bits, got {checks!r}")
    if token_pool is not None:
        if not isinstance(token_pool, TokenPool):
            raise CanaryInputError(f"token_pool must be a TokenPool, got {type(token_pool).__name__}")
        check_tensor(token_pool.tokens, "token pool", ndim=2, device=device)
    check_fingerprint(fingerprint, group, stage, seal=True)
    ws = empty_i64(device) if workspace is None else check_tensor(workspace, "workspace", ndim=1, device=device)
    cs = _check_carries(carries, checks, device)
    tags = group.tags(stage)
    b = check_backend(backend, device)
    if b == "torch":
        return WriteTarget(_write_torch, (group, tags), s, (page, sink, checks, token_pool, fingerprint), False,
                           device)
    e = empty_i64(device)
    return WriteTarget(_native.module(b).write, (
        group.records, e if group.swa_map is None else group.swa_map, int(group.swa_map is not None),
        group.reserved_slots, tags[0], tags[1] if len(tags) > 1 else -1), s, (
        sink.rows, sink.count, sink.counters, sink.step, checks,
        e if token_pool is None else token_pool.tokens, e if token_pool is None else token_pool.lens,
        int(token_pool is not None), 0 if token_pool is None else token_pool.offset,
        e if fingerprint is None else fingerprint.sources.table,
        int(FingerprintMode.NONE) if fingerprint is None else int(fingerprint.mode),
        1 if fingerprint is None else fingerprint.layer_stride, page, ws, cs), True, device)


def bind_write(group: GroupView, stage: Stage, plan: torch.Tensor, status: torch.Tensor, table: torch.Tensor,
               input_ids: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor, sink: Sink, *,
               checks: int = 0, token_pool: TokenPool | None = None, fingerprint: Fingerprint | None = None,
               table_page: int = 1, workspace: torch.Tensor | None = None, carries: torch.Tensor | None = None,
               backend: str = "torch") -> BoundOp:
    """:func:`write`'s arguments checked once: a call taking the slot table (see :class:`BoundOp`)."""
    return write_target(group, stage, status, table, sink, checks=checks, token_pool=token_pool,
                        fingerprint=fingerprint, table_page=table_page, workspace=workspace, carries=carries,
                        backend=backend).bind(plan, input_ids, positions, out_cache_loc)


def _check_carries(carries: torch.Tensor | None, checks: int, device: torch.device) -> torch.Tensor:
    """The carries argument of a write with WriteCheck bits ``checks``: required with a carry bit (one at most), then
    ``[1 + E, NUM_CARRY_COLS]``; the 0-element tensor when absent."""
    bits = checks & _CARRY_BITS
    if bits == _CARRY_BITS:
        raise CanaryInputError("checks: RECORD_CARRIES and REUSE_CARRIES exclude each other")
    if carries is None:
        if bits:
            raise CanaryInputError("checks RECORD_CARRIES / REUSE_CARRIES need a carries tensor (write_carries)")
        return empty_i64(device)
    c = check_tensor(carries, "carries", ndim=2, device=device, shape=(None, NUM_CARRY_COLS))
    if c.shape[0] < 1:
        raise CanaryInputError("carries needs its header row: shape [1 + entries, NUM_CARRY_COLS]")
    return c


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


def _at(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """x[i] for a 1-D x (index_select: several times faster than advanced indexing on CPU)."""
    return x.index_select(0, i)


def _bit(mask: torch.Tensor, reason: FailReason) -> torch.Tensor:
    return mask.to(torch.int64) * int(reason)


def _structural_rows(group: GroupView, table: torch.Tensor, page: int, segs: torch.Tensor, j: torch.Tensor,
                     lc: torch.Tensor, t: torch.Tensor,
                     p: torch.Tensor) -> tuple[torch.Tensor, dict[ViolationCol, torch.Tensor | int]]:
    """Entries failing the structural check (csrc/core/write.cuh write_structural) and their row columns.

    ``segs`` are the entries' plan rows [E, NUM_PLAN_COLS], ``j`` their index in the segment, ``lc`` / ``t`` / ``p``
    their out_cache_loc / token / position.
    """
    num_rows, stride = table.shape
    row_len = stride * page
    padding = (segs[:, PlanCol.FLAGS] & int(PlanFlag.PADDING)) != 0
    row, idx = segs[:, PlanCol.ROW], segs[:, PlanCol.PREFIX_LEN] + j
    in_table = (row >= 0) & (row < num_rows) & (idx >= 0) & (idx < row_len)
    zero = torch.zeros_like(idx)
    flat = table.reshape(-1).to(torch.int64)
    cell = table_slots(flat, stride, page, torch.where(in_table, row, zero), torch.where(in_table, idx, zero)) \
        if flat.numel() else zero
    outcome, _ = resolve_slots(group, lc)
    pad_bad = padding & (outcome != RESERVED) & (outcome != EVICTED)
    req_bad = ~padding & in_table & (cell != lc)
    hit = torch.nonzero((lc >= 0) & (pad_bad | req_bad)).squeeze(1)
    expected = torch.where(padding, torch.full_like(cell, NO_SLOT), cell)
    return hit, {ViolationCol.SLOT: lc[hit], ViolationCol.EXPECTED_SLOT: expected[hit], ViolationCol.POSITION: idx[hit],
                 ViolationCol.STORED_POSITION: p[hit], ViolationCol.STORED_TOKEN: t[hit]}


def _write_torch(group: GroupView, tags: list[int], plan: torch.Tensor, status: torch.Tensor, table: torch.Tensor,
                 page: int, ids: torch.Tensor, pos: torch.Tensor, loc: torch.Tensor, sink: Sink, checks: int,
                 pool: TokenPool | None, fp: Fingerprint | None) -> None:
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

    def add_rows(tag: int, reasons: torch.Tensor | int, segs: torch.Tensor,
                 cols: dict[ViolationCol, torch.Tensor | int]) -> None:
        """Violation rows of plan rows ``segs`` [n, NUM_PLAN_COLS] with the given column values."""
        if segs.shape[0] == 0:
            return
        r = violation_rows(segs.shape[0], dev)
        r[:, ViolationCol.TAG] = tag
        r[:, ViolationCol.REASONS] = reasons
        r[:, ViolationCol.BATCH_INDEX] = segs[:, PlanCol.BATCH_INDEX]
        r[:, ViolationCol.REQ_ROW] = segs[:, PlanCol.ROW]
        for c, v in cols.items():
            r[:, c] = v
        out.append(r)

    bad = seg[~range_ok]
    for tag in tags:  # write_emit_range_error
        add_rows(tag, int(FailReason.INPUT_ERROR), bad, {ViolationCol.SLOT: NO_SLOT,
                                                          ViolationCol.POSITION: bad[:, PlanCol.PREFIX_LEN]})
        sink.counters[tag, CounterCol.INPUT_ERRORS] += bad.shape[0]

    good = seg[range_ok]
    wb, wl = good[:, PlanCol.WRITE_BEGIN], good[:, PlanCol.WRITE_LEN]
    flags = good[:, PlanCol.FLAGS]
    # Seeds [G] per half (write_seed).
    seed_head = (flags & int(PlanFlag.SEED_IS_HEAD)) != 0
    s_out, s_slot = resolve_slots(group, good[:, PlanCol.SEED_SLOT])
    s_res = s_out == OK
    seed_rec = group.records[torch.where(s_res, s_slot, torch.zeros_like(s_slot))] if group.num_slots else \
        torch.zeros(good.shape[0], group.halves, group.records.shape[2], dtype=torch.int64, device=dev)
    seed_ok, seed_h, seed_prev = [], [], []
    for h in range(group.halves):
        has_link, link = record_link(seed_rec[:, h])
        seed_ok.append(seed_head | (s_res & has_link))
        seed_h.append(torch.where(seed_head, torch.full_like(link, H.chain_h0()), link))
        seed_prev.append(torch.where(seed_head, torch.full_like(link, -1), seed_rec[:, h, RecordField.POSITION]))

    # Entries (write_entry_load): E = sum of WRITE_LEN over the good segments; sid = segment of each entry.
    seg_start = _excl_cumsum(wl)
    sid = torch.repeat_interleave(torch.arange(good.shape[0], device=dev), wl)
    e_count = sid.shape[0]
    ar = torch.arange(e_count, device=dev)
    e0 = _at(seg_start, sid)
    j = ar - e0
    k = _at(wb, sid) + j
    t, p, lc = _at(ids, k), _at(pos, k), _at(loc, k)
    outcome, slot = resolve_slots(group, lc)
    pad = (lc < 0) | ((_at(flags, sid) & int(PlanFlag.PADDING)) != 0)  # PADDING segments are never written
    placed = ~pad & ((outcome == OK) | (outcome == RESERVED))
    active = placed & H.chain_value_ok(t) & H.chain_value_ok(p)
    skip_err = ~pad & ~active & (outcome != EVICTED)  # slot input error or bad token/position
    evicted = ~pad & (outcome == EVICTED)
    expected_pos = _at(good[:, PlanCol.PREFIX_LEN].contiguous(), sid) + j
    if checks & WriteCheck.STRUCTURAL:
        hit, cols = _structural_rows(group, table, page, good[sid], j, lc, t, p)
        add_rows(tags[0], int(FailReason.STRUCTURAL), good[sid[hit]], cols)

    # Exclusive affine scan per segment via prefix sums: with C = number of active entries before i (global) and
    # S = sum over earlier active m of g_m * B^-(C_m + 1), h_before(i) = B^C_i * (B^-C_e0 * seed + S_i - S_e0).
    cx = _excl_cumsum(active.to(torch.int64))
    pw = powers(CHAIN_BASE, e_count + 1, dev)
    ipw = powers(_CHAIN_BASE_INV, e_count + 2, dev)
    zero = torch.zeros_like(t)
    g = H.chain_g(torch.where(active, t, zero), torch.where(active, p, zero))
    c_i = cx[:-1]
    sx = _excl_cumsum(torch.where(active, g * _at(ipw, c_i + 1), zero))
    scan_i = _at(pw, c_i)  # B^C_i
    scan_b = sx[:-1] - _at(sx, e0)  # S_i - S_e0
    scan_a = _at(ipw, _at(cx, e0))  # B^-C_e0
    seg_end = seg_start[1:]
    st = seg_start[:-1]
    # Index of the last active entry at or before i (cummax), then the exclusive one.
    last_incl = torch.cummax(torch.where(active, ar, torch.full_like(ar, -1)), 0).values if e_count else ar
    last_excl = torch.cat([torch.full((1,), -1, dtype=torch.int64, device=dev), last_incl[:-1]])[:e_count]
    prev_written = _at(p, torch.clamp(last_excl, min=0))
    has_prev = last_excl >= e0
    seg_last = last_incl[seg_end - 1] if e_count else seg_end
    seg_wrote = seg_last >= st

    pool_tok = torch.full_like(t, SKIP_TOKEN)
    if pool is not None and checks & WriteCheck.INPUTS:
        nr, nc = pool.tokens.shape
        prow = _at(good[:, PlanCol.ROW].contiguous(), sid)
        q = p + pool.offset
        in_pool = (prow >= 0) & (prow < nr) & (q >= 0) & (q < nc)
        prc = torch.clamp(prow, 0, max(nr - 1, 0))
        qc = torch.clamp(q, 0, max(nc - 1, 0))
        if nr and nc:
            in_pool &= q < pool.lens[prc]
            pool_tok = torch.where(in_pool, pool.tokens[prc, qc], pool_tok)

    for h, tag in enumerate(tags):
        seed_all_ok = bool(seed_ok[h].all())
        live = seed_ok[h][sid]
        bad_seed = good[~seed_ok[h]]
        add_rows(tag, int(FailReason.INPUT_ERROR), bad_seed, {
            ViolationCol.SLOT: bad_seed[:, PlanCol.SEED_SLOT],
            ViolationCol.POSITION: bad_seed[:, PlanCol.PREFIX_LEN] - 1})
        sink.counters[tag, CounterCol.INPUT_ERRORS] += bad_seed.shape[0]
        ei = torch.nonzero(live & skip_err).squeeze(1)
        add_rows(tag, int(FailReason.INPUT_ERROR), good[sid[ei]], {
            ViolationCol.SLOT: slot[ei], ViolationCol.POSITION: expected_pos[ei], ViolationCol.STORED_POSITION: p[ei],
            ViolationCol.STORED_TOKEN: t[ei]})
        sink.counters[tag, CounterCol.INPUT_ERRORS] += ei.shape[0]
        sink.counters[tag, CounterCol.SKIPPED] += (live & evicted).sum()
        # Written entries: wi indexes them (all entries when every entry is written: no gathers).
        w = live & active
        every = seed_all_ok and bool(w.all())
        wi = ar if every else torch.nonzero(w).squeeze(1)

        def sel(x: torch.Tensor, wi: torch.Tensor = wi, every: bool = every) -> torch.Tensor:
            return x if every else _at(x, wi)

        ws, wp, wt, wsid = sel(slot), sel(p), sel(t), sel(sid)
        h_before = sel(scan_i) * (sel(scan_a) * _at(seed_h[h], wsid) + sel(scan_b))
        prev_pos = torch.where(sel(has_prev), sel(prev_written), _at(seed_prev[h], wsid))
        reasons = torch.zeros_like(wp)
        if checks & WriteCheck.CHAIN_POSITION:
            reasons |= _bit(wp != prev_pos + 1, FailReason.WRITE_POSITION)
        if checks & WriteCheck.INPUTS:
            wtok = sel(pool_tok)
            reasons |= _bit(wp != sel(expected_pos), FailReason.WRITE_POSITION)
            reasons |= _bit((wtok != SKIP_TOKEN) & (wt != wtok), FailReason.WRITE_TOKEN)
        fpv = torch.zeros_like(ws) if fp is None else fingerprint_torch(fp.sources, h, ws, wp, fp.mode,
                                                                         fp.layer_stride)
        flat = group.records.view(-1, group.records.shape[2])
        flat.index_copy_(0, ws * group.halves + h, torch.stack([wt, wp, h_before, fpv], 1))
        sink.counters[tag, CounterCol.ENTRIES_WRITTEN] += wi.shape[0]
        hit = torch.nonzero(reasons).squeeze(1)
        add_rows(tag, reasons[hit], good[wsid[hit]], {
            ViolationCol.SLOT: ws[hit], ViolationCol.POSITION: expected_pos[wi[hit]],
            ViolationCol.STORED_POSITION: wp[hit], ViolationCol.STORED_TOKEN: wt[hit],
            ViolationCol.EXPECTED_TOKEN: pool_tok[wi[hit]], ViolationCol.STORED_HASH: h_before[hit],
            ViolationCol.STORED_FP: fpv[hit]})
        # EXPECT_NEW boundary (write_expect_new).
        h_end = pw[cx[seg_end]] * (ipw[cx[st]] * seed_h[h] + sx[seg_end] - sx[st])
        want = good[:, PlanCol.EXPECT_NEW]
        miss = torch.nonzero(seed_ok[h] & seg_wrote & ((flags & int(PlanFlag.EXPECT_NEW)) != 0)
                             & (h_end != want)).squeeze(1)
        li = seg_last[miss]
        add_rows(tag, int(FailReason.WRITE_TOKEN), good[miss], {
            ViolationCol.SLOT: slot[li], ViolationCol.POSITION: expected_pos[li], ViolationCol.STORED_POSITION: p[li],
            ViolationCol.STORED_TOKEN: t[li], ViolationCol.STORED_HASH: h_end[miss],
            ViolationCol.EXPECTED_HASH: want[miss]})
    if out:
        append_rows(sink, torch.cat(out))
