"""Verify op (docs/ops-contract.md 4): check the records of planned prefix entries, torch reference + native."""

from __future__ import annotations

import torch
from kvcanary_schema import (
    NO_SLOT,
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
)

from kvcanary import _native
from kvcanary.errors import CanaryInputError
from kvcanary.ops import hashes as H
from kvcanary.ops.bound import BoundOp, Shaped
from kvcanary.ops.fingerprint import check_fingerprint, fingerprint_torch
from kvcanary.ops.plan import check_plan_buffers, check_scalar, check_table_page, empty_i64
from kvcanary.ops.shared import (
    EVICTED,
    INPUT_ERROR,
    OK,
    RESERVED,
    append_rows,
    record_link,
    resolve_slots,
    table_slots,
    violation_rows,
)
from kvcanary.ops.types import (
    Fingerprint,
    GroupView,
    Sink,
    TokenPool,
    check_backend,
    check_tensor,
)


def verify(group: GroupView, stage: Stage, plan: torch.Tensor, status: torch.Tensor, table: torch.Tensor,
           sink: Sink, *, token_pool: TokenPool | None = None, fingerprint: Fingerprint | None = None,
           table_page: int = 1, max_segment_entries: int = 0, backend: str = "torch") -> None:
    """Verify every planned prefix entry of one stage and group, both halves, into ``sink``.

    ``table`` is the int32/int64 slot table ``[R, L]`` the plan was made from (a sweep's flat slots viewed as
    ``[1, N]``), or with ``table_page`` > 1 a block table (see :func:`kvcanary.ops.plan.plan_forward`). HEAD stages
    take no fingerprint. Bad values inside tensors are counted as INPUT_ERROR rows. ``max_segment_entries`` > 0 is
    the caller's bound on any segment's entries (a plan of window ``W``: ``W``), which the CUDA backend sizes its grid
    from; it changes no result (a longer segment is still verified whole).
    """
    bind_verify(group, stage, plan, status, table, sink, token_pool=token_pool, fingerprint=fingerprint,
                table_page=table_page, max_segment_entries=max_segment_entries, backend=backend)(table)


def bind_verify(group: GroupView, stage: Stage, plan: torch.Tensor, status: torch.Tensor, table: torch.Tensor,
                sink: Sink, *, token_pool: TokenPool | None = None, fingerprint: Fingerprint | None = None,
                table_page: int = 1, max_segment_entries: int = 0, backend: str = "torch") -> BoundOp:
    """:func:`verify`'s arguments checked once: a call taking the slot table (see :class:`BoundOp`)."""
    if not isinstance(group, GroupView):
        raise CanaryInputError(f"group must be a GroupView, got {type(group).__name__}")
    if not isinstance(stage, Stage):
        raise CanaryInputError(f"stage must be a Stage, got {stage!r}")
    device = group.records.device
    p, s = check_plan_buffers(plan, status, device)
    tbl = check_tensor(table, "table", dtype=(torch.int32, torch.int64), ndim=2, device=device)
    page = check_table_page(tbl, table_page)
    if not isinstance(sink, Sink):
        raise CanaryInputError(f"sink must be a Sink, got {type(sink).__name__}")
    sink.validate(device)
    if token_pool is not None:
        if not isinstance(token_pool, TokenPool):
            raise CanaryInputError(f"token_pool must be a TokenPool, got {type(token_pool).__name__}")
        check_tensor(token_pool.tokens, "token pool", ndim=2, device=device)
    check_fingerprint(fingerprint, group, stage)
    check_scalar(max_segment_entries, "max_segment_entries", 0)
    tags = group.tags(stage)
    share = fingerprint.share if fingerprint is not None and stage == Stage.TAIL else 1  # sweeps check every entry
    b = check_backend(backend, device)
    sp = Shaped(p, ShapedArg.PLAN_ROWS)  # a forward's plan follows the batch (BoundOp)
    if b == "torch":
        return BoundOp.of(_verify_torch, (group, tags, sp, s), (page, sink, token_pool, fingerprint, share))
    e = empty_i64(device)
    return BoundOp.of(_native.module(b).verify, (
        group.records, e if group.swa_map is None else group.swa_map, int(group.swa_map is not None),
        group.reserved_slots, tags[0], tags[1] if len(tags) > 1 else -1, sp, s), (
        sink.rows, sink.count, sink.counters, sink.step,
        e if token_pool is None else token_pool.tokens, e if token_pool is None else token_pool.lens,
        int(token_pool is not None), 0 if token_pool is None else token_pool.offset,
        e if fingerprint is None else fingerprint.sources.table,
        int(FingerprintMode.NONE) if fingerprint is None else int(fingerprint.mode),
        1 if fingerprint is None else fingerprint.layer_stride, page, share, max_segment_entries), native=True)


# ---- torch reference -------------------------------------------------------------------------------------------

def _verify_torch(group: GroupView, tags: list[int], plan: torch.Tensor, status: torch.Tensor,
                  table: torch.Tensor, page: int, sink: Sink, pool: TokenPool | None, fp: Fingerprint | None,
                  share: int) -> None:
    dev = group.records.device
    num_rows, stride = table.shape
    row_len = stride * page
    for tag in tags:
        sink.counters[tag, CounterCol.VERIFY_RUNS] += 1
    nseg = int(torch.clamp(status[PlanStatusCol.NUM_SEGMENTS], 0, plan.shape[0]).item())
    seg = plan[:nseg]
    row, begin, end = seg[:, PlanCol.ROW], seg[:, PlanCol.IDX_BEGIN], seg[:, PlanCol.IDX_END]
    seg_ok = (row >= 0) & (row < num_rows) & (begin >= 0) & (begin <= end) & (end <= row_len)
    out: list[torch.Tensor] = []

    bad = seg[~seg_ok]
    for tag in tags:  # a bad segment: one INPUT_ERROR row per half (csrc/core/verify.cuh verify_emit_bad_segment)
        r = violation_rows(bad.shape[0], dev)
        r[:, ViolationCol.TAG] = tag
        r[:, ViolationCol.REASONS] = int(FailReason.INPUT_ERROR)
        r[:, ViolationCol.SLOT] = NO_SLOT
        r[:, ViolationCol.BATCH_INDEX] = bad[:, PlanCol.BATCH_INDEX]
        r[:, ViolationCol.REQ_ROW] = bad[:, PlanCol.ROW]
        out.append(r)
        sink.counters[tag, CounterCol.INPUT_ERRORS] += bad.shape[0]

    good = seg[seg_ok]
    lens = good[:, PlanCol.IDX_END] - good[:, PlanCol.IDX_BEGIN]
    sid = torch.repeat_interleave(torch.arange(good.shape[0], device=dev), lens)
    total = sid.shape[0]
    cols = good.t().contiguous()  # [NUM_PLAN_COLS, segments]: per-column 1-D gathers beat 2-D row gathers

    def at(c: PlanCol, seg_ids: torch.Tensor) -> torch.Tensor:
        return cols[c].index_select(0, seg_ids)

    begin_e = at(PlanCol.IDX_BEGIN, sid)
    idx = begin_e + torch.arange(total, device=dev) - (torch.cumsum(lens, 0) - lens)[sid]
    rowv = at(PlanCol.ROW, sid)
    flat = table.reshape(-1).to(torch.int64)
    t = table_slots(flat, stride, page, rowv, idx) if total else torch.zeros(0, dtype=torch.int64, device=dev)
    pos = idx + at(PlanCol.POS_SHIFT, sid)
    outcome, slot = resolve_slots(group, t)
    first = idx == begin_e
    anchor = first & ((at(PlanCol.FLAGS, sid) & int(PlanFlag.FIRST_IS_HEAD)) != 0)
    prev_t = table_slots(flat, stride, page, rowv, torch.clamp(idx - 1, min=0)) if total else t
    pt = torch.where(first, at(PlanCol.FIRST_PREV_SLOT, sid), prev_t)
    p_outcome, p_slot = resolve_slots(group, pt)
    pred_ok = ~anchor & (p_outcome == OK)
    has_pred = anchor | pred_ok

    err = outcome == INPUT_ERROR
    skipped = (outcome == EVICTED) | (outcome == RESERVED)
    ok = outcome == OK
    for tag in tags:
        r = violation_rows(int(err.sum()), dev)
        r[:, ViolationCol.TAG] = tag
        r[:, ViolationCol.REASONS] = int(FailReason.INPUT_ERROR)
        r[:, ViolationCol.SLOT] = slot[err]
        r[:, ViolationCol.POSITION] = pos[err]
        r[:, ViolationCol.BATCH_INDEX] = at(PlanCol.BATCH_INDEX, sid[err])
        r[:, ViolationCol.REQ_ROW] = rowv[err]
        out.append(r)
        sink.counters[tag, CounterCol.INPUT_ERRORS] += err.sum()
        sink.counters[tag, CounterCol.SKIPPED] += skipped.sum()
        sink.counters[tag, CounterCol.ENTRIES_CHECKED] += ok.sum()

    # Checked entries only from here on.
    # One nonzero + index_select per tensor: boolean-mask indexing would recompute the mask's nonzero each time.
    sel = ok.nonzero().squeeze(1)
    every = sel.numel() == ok.numel()  # the common case: nothing skipped, no gathers needed

    def take(x: torch.Tensor) -> torch.Tensor:
        return x if every else x.index_select(0, sel)

    s, p, i, sid_ok = take(slot), take(pos), take(idx), take(sid)
    anc, hp = take(anchor), take(has_pred)
    row_ok, expect = at(PlanCol.ROW, sid_ok), at(PlanCol.EXPECT_PREFIX, sid_ok)
    boundary = ((at(PlanCol.FLAGS, sid_ok) & int(PlanFlag.EXPECT_PREFIX)) != 0) & (i == at(PlanCol.IDX_END, sid_ok) - 1)
    if pool is not None:
        pool_rows, pool_cols = pool.tokens.shape
        q = p + pool.offset
        in_pool = (row_ok < pool_rows) & (q >= 0) & (q < pool_cols)
        expected_token = torch.full_like(q, SKIP_TOKEN)
        if pool.tokens.numel():
            prow = torch.clamp(row_ok, max=pool_rows - 1)
            in_pool &= q < pool.lens[prow]
            pool_tok = pool.tokens[prow, torch.clamp(q, 0, pool_cols - 1)]
            expected_token = torch.where(in_pool, pool_tok, expected_token)
    # One gather of a slot's K and V records together (they are adjacent), for the entries and their predecessors.
    nf = group.records.shape[-1]
    by_slot = group.records.view(group.num_slots, -1)
    rec_all = by_slot.index_select(0, s)
    # Inside a segment an entry's predecessor is the previous entry (same table cell), whose own link is computed
    # anyway; only segment starts gather their FIRST_PREV_SLOT record. Unresolved predecessors are never read.
    starts = first.nonzero().squeeze(1)
    start_pred = by_slot.index_select(0, torch.where(pred_ok[starts], p_slot[starts], torch.zeros_like(starts)))
    for h, tag in enumerate(tags):
        rec = rec_all[:, h * nf:(h + 1) * nf]
        r_tok, r_pos = rec[:, RecordField.TOKEN], rec[:, RecordField.POSITION]
        r_prev, r_fp = rec[:, RecordField.PREV_HASH], rec[:, RecordField.KV_FINGERPRINT]
        own_has_link, own_link = record_link(rec)
        pred_has_link, pred_link = _predecessor_links(own_has_link, own_link, sel, every, total, starts,
                                                     record_link(start_pred[:, h * nf:(h + 1) * nf]))
        pred_has_link, pred_link = take(pred_has_link), take(pred_link)
        chain_expected = torch.where(anc, torch.full_like(s, H.chain_h0()),
                                     torch.where(pred_has_link, pred_link, torch.zeros_like(s)))
        chain_bad = hp & (~(anc | pred_has_link) | (r_prev != chain_expected))
        bnd_nolink = boundary & ~own_has_link
        bnd_mismatch = boundary & own_has_link & (own_link != expect)
        reasons = (_bit(r_pos != p, FailReason.VERIFY_POSITION) | _bit(chain_bad | bnd_nolink, FailReason.VERIFY_CHAIN)
                   | _bit(bnd_mismatch, FailReason.VERIFY_TOKEN))
        exp_tok = torch.full_like(s, SKIP_TOKEN)
        if pool is not None:
            exp_tok = expected_token
            reasons |= _bit(in_pool & (r_tok != exp_tok), FailReason.VERIFY_TOKEN)
        exp_fp = torch.zeros_like(s)
        if fp is not None:
            # the share (csrc/core/verify.cuh verify_fp_selected): & (S - 1) is the u64 remainder on int64 too
            chosen = ((p + at(PlanCol.PREFIX_LEN, sid_ok)) & (share - 1)) == 0
            exp_fp = torch.where(chosen, fingerprint_torch(fp.sources, h, s, p, fp.mode, fp.layer_stride), exp_fp)
            reasons |= _bit(chosen & (r_fp != exp_fp), FailReason.VERIFY_FINGERPRINT)
        hit = reasons != 0
        r = violation_rows(int(hit.sum()), dev)
        r[:, ViolationCol.TAG] = tag
        r[:, ViolationCol.REASONS] = reasons[hit]
        r[:, ViolationCol.SLOT] = s[hit]
        r[:, ViolationCol.POSITION] = p[hit]
        r[:, ViolationCol.STORED_POSITION] = r_pos[hit]
        r[:, ViolationCol.BATCH_INDEX] = at(PlanCol.BATCH_INDEX, sid_ok[hit])
        r[:, ViolationCol.REQ_ROW] = row_ok[hit]
        r[:, ViolationCol.STORED_TOKEN] = r_tok[hit]
        r[:, ViolationCol.EXPECTED_TOKEN] = exp_tok[hit]
        r[:, ViolationCol.STORED_HASH] = torch.where(bnd_mismatch & ~chain_bad, own_link, r_prev)[hit]
        r[:, ViolationCol.EXPECTED_HASH] = torch.where(
            chain_bad, chain_expected, torch.where(bnd_mismatch, expect, torch.zeros_like(s)))[hit]
        r[:, ViolationCol.STORED_FP] = r_fp[hit]
        r[:, ViolationCol.EXPECTED_FP] = exp_fp[hit]
        out.append(r)
    append_rows(sink, torch.cat(out) if out else violation_rows(0, dev))


def _predecessor_links(has: torch.Tensor, link: torch.Tensor, sel: torch.Tensor, every: bool, total: int,
                       starts: torch.Tensor, start_links: tuple[torch.Tensor, torch.Tensor]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(has_link, link) of every entry's predecessor, over all entries: the previous entry's, or the segment start's."""
    if every:
        full_has, full_link = has, link
    else:
        full_has = torch.zeros(total, dtype=torch.bool, device=link.device).index_copy_(0, sel, has)
        full_link = torch.zeros(total, dtype=link.dtype, device=link.device).index_copy_(0, sel, link)
    prev_has, prev_link = full_has.roll(1), full_link.roll(1)
    prev_has[starts], prev_link[starts] = start_links
    return prev_has, prev_link


def _bit(mask: torch.Tensor, reason: FailReason) -> torch.Tensor:
    return mask.to(torch.int64) * int(reason)
