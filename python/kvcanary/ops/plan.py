"""Plan ops (docs/ops-contract.md 2-3): per-request / per-chain verify and write segments, torch reference + native."""

from __future__ import annotations

from collections.abc import Callable

import torch
from kvcanary_schema import NO_SLOT, NUM_PLAN_COLS, NUM_PLAN_STATUS_COLS, PlanCol, PlanFlag, PlanStatusCol, ShapedArg

from kvcanary import _native
from kvcanary.errors import CanaryInputError
from kvcanary.ops.bound import BoundOp, Shaped
from kvcanary.ops.shared import table_slots
from kvcanary.ops.types import check_backend, check_tensor, overlaps

_MAX_TABLE_POSITIONS = 1 << 40  # logical row length bound (csrc/core/tensor_checks.h slot_table_of)

_EMPTY: dict[torch.device, torch.Tensor] = {}


def empty_i64(device: torch.device) -> torch.Tensor:
    """The cached 0-element int64 tensor passed for an absent optional tensor (one per device)."""
    t = _EMPTY.get(device)
    if t is None:
        t = _EMPTY[device] = torch.empty(0, dtype=torch.int64, device=device)
    return t


def check_plan_buffers(plan: object, status: object, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate the plan [cap, NUM_PLAN_COLS] and status [NUM_PLAN_STATUS_COLS] buffers (int64, contiguous)."""
    p = check_tensor(plan, "plan", ndim=2, device=device, shape=(None, NUM_PLAN_COLS))
    s = check_tensor(status, "status", ndim=1, device=device, shape=(NUM_PLAN_STATUS_COLS,))
    return p, s


def check_scalar(v: object, name: str, lo: int) -> int:
    """``v`` when it is an int (not a bool) >= ``lo``, else CanaryInputError."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise CanaryInputError(f"{name} must be an int, got {type(v).__name__}")
    if v < lo:
        raise CanaryInputError(f"{name} must be >= {lo}, got {v}")
    return v


def check_table_page(table: torch.Tensor, table_page: int) -> int:
    """``table_page`` (slots per slot-table entry) as an int >= 1 whose logical row length stays in range."""
    page = check_scalar(table_page, "table_page", 1)
    if table.shape[1] > _MAX_TABLE_POSITIONS // page:
        raise CanaryInputError(f"slot table of {table.shape[1]} entries x table_page {page} exceeds the position range")
    return page


def plan_forward(plan: torch.Tensor, status: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                 extend_lens: torch.Tensor, req_to_token: torch.Tensor, num_tokens: int, *, window: int = 0,
                 padding_row: int = -1, expect_prefix: torch.Tensor | None = None,
                 expect_new: torch.Tensor | None = None, flag_mask: torch.Tensor | None = None, table_page: int = 1,
                 reuse: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, tick: torch.Tensor | None = None,
                 backend: str = "torch") -> None:
    """Plan one forward's segments into ``plan`` and overwrite ``status`` (docs/ops-contract.md 2); ``tick`` (int64
    ``[k]``): each element incremented once by the call (the pre stage's step and phase counter).

    ``reuse = (reuse_plan, reuse_status, reuse_lens)`` also plans, in the same call (one launch on CUDA), the reuse
    check: exactly ``plan_forward(reuse_plan, reuse_status, req_pool_indices, reuse_lens, zeros, req_to_token,
    num_tokens, padding_row=padding_row, table_page=table_page)`` (window 0, no new tokens, no expected values).

    ``req_pool_indices``, ``prefix_lens``, ``extend_lens`` (and the optional ``expect_prefix`` / ``expect_new``
    chain values and ``flag_mask``: request i's rows get ``FLAGS &= flag_mask[i]``; the reuse plan no mask) are
    int64 ``[bs]``; ``req_to_token`` is the int32/int64 slot table ``[R, L]``, or with ``table_page`` P > 1 a block
    table ``[R, B]`` of block ids (slot = block * P + position % P, L = B * P); ``plan`` needs ``cap >= bs`` rows.
    Bad values inside the tensors are counted in ``status`` (never raised).
    """
    bind_plan_forward(plan, status, req_pool_indices, prefix_lens, extend_lens, req_to_token, num_tokens,
                      window=window, padding_row=padding_row, expect_prefix=expect_prefix, expect_new=expect_new,
                      flag_mask=flag_mask, table_page=table_page, reuse=reuse, tick=tick,
                      backend=backend)(req_to_token)


def bind_plan_forward(plan: torch.Tensor, status: torch.Tensor, req_pool_indices: torch.Tensor,
                      prefix_lens: torch.Tensor, extend_lens: torch.Tensor, req_to_token: torch.Tensor, num_tokens: int,
                      *, window: int = 0, padding_row: int = -1, expect_prefix: torch.Tensor | None = None,
                      expect_new: torch.Tensor | None = None, flag_mask: torch.Tensor | None = None,
                      table_page: int = 1, reuse: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                      tick: torch.Tensor | None = None, backend: str = "torch") -> BoundOp:
    """:func:`plan_forward`'s arguments checked once: a call taking the slot table (see :class:`BoundOp`)."""
    device = req_pool_indices.device if isinstance(req_pool_indices, torch.Tensor) else torch.device("cpu")
    rpi = check_tensor(req_pool_indices, "req_pool_indices", ndim=1)
    bs = rpi.shape[0]
    pre = check_tensor(prefix_lens, "prefix_lens", ndim=1, device=device, shape=(bs,))
    ext = check_tensor(extend_lens, "extend_lens", ndim=1, device=device, shape=(bs,))
    table = check_tensor(req_to_token, "req_to_token", dtype=(torch.int32, torch.int64), ndim=2, device=device)
    p, s = check_plan_buffers(plan, status, device)
    if p.shape[0] < bs:
        raise CanaryInputError(f"plan has {p.shape[0]} rows, batch has {bs} requests")
    ep = None if expect_prefix is None else check_tensor(expect_prefix, "expect_prefix", ndim=1, device=device,
                                                         shape=(bs,))
    en = None if expect_new is None else check_tensor(expect_new, "expect_new", ndim=1, device=device, shape=(bs,))
    fm = None if flag_mask is None else check_tensor(flag_mask, "flag_mask", ndim=1, device=device, shape=(bs,))
    num_tokens = check_scalar(num_tokens, "num_tokens", 0)
    window = check_scalar(window, "window", 0)
    padding_row = check_scalar(padding_row, "padding_row", -1)
    table_page = check_table_page(table, table_page)
    rp, rs, rl = _check_reuse(reuse, p, s, device, bs)
    tk = empty_i64(device) if tick is None else check_tensor(tick, "tick", ndim=1, device=device)
    if any(overlaps(tk, t) for t in (p, s, rp, rs)):
        raise CanaryInputError("tick must not overlap the plan or status buffers")
    b = check_backend(backend, device)
    # what follows the batch (BoundOp): the plans' rows, the per-request rows, the token count (an absent reuse plan
    # is a 0-element placeholder)
    sp, srp = Shaped(p, ShapedArg.PLAN_ROWS), rp if rl is None else Shaped(rp, ShapedArg.PLAN_ROWS)
    srpi, spre, sext = (Shaped(t, ShapedArg.BATCH_ROWS) for t in (rpi, pre, ext))
    sep, sen, sfm, srl = (None if t is None else Shaped(t, ShapedArg.BATCH_ROWS) for t in (ep, en, fm, rl))
    nt = Shaped(num_tokens, ShapedArg.NUM_TOKENS)
    if b == "torch":
        return BoundOp.of(_plan_forward_torch_with_reuse, (sp, s, srpi, spre, sext),
                          (nt, window, padding_row, sep, sen, sfm, table_page, srp, rs, srl, tk))
    e = empty_i64(device)
    return BoundOp.of(_native.module(b).plan_forward, (sp, s, srpi, spre, sext),
                      (e if sep is None else sep, int(ep is not None), e if sen is None else sen, int(en is not None),
                       e if sfm is None else sfm, int(fm is not None), nt, window, padding_row, table_page, srp, rs,
                       e if srl is None else srl, int(rl is not None), tk), native=True)


def _check_reuse(reuse: object, plan: torch.Tensor, status: torch.Tensor, device: torch.device,
                 bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(reuse_plan, reuse_status, reuse_lens) validated, or (0-element, 0-element, None) when ``reuse`` is None."""
    if reuse is None:
        e = empty_i64(device)
        return e, e, None
    if not isinstance(reuse, tuple) or len(reuse) != 3:
        raise CanaryInputError("reuse must be a (reuse_plan, reuse_status, reuse_lens) tuple")
    rp = check_tensor(reuse[0], "reuse_plan", ndim=2, device=device, shape=(None, NUM_PLAN_COLS))
    rs = check_tensor(reuse[1], "reuse_status", ndim=1, device=device, shape=(NUM_PLAN_STATUS_COLS,))
    rl = check_tensor(reuse[2], "reuse_lens", ndim=1, device=device, shape=(bs,))
    if rp.shape[0] < bs:
        raise CanaryInputError(f"reuse_plan has {rp.shape[0]} rows, batch has {bs} requests")
    if (rp.numel() and rp.data_ptr() == plan.data_ptr()) or rs.data_ptr() == status.data_ptr():
        raise CanaryInputError("reuse_plan / reuse_status must be other buffers than plan / status")
    return rp, rs, rl


def plan_sweep(plan: torch.Tensor, status: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor,
               lens: torch.Tensor, first_positions: torch.Tensor, prev_slots: torch.Tensor, *,
               expect_end: torch.Tensor | None = None, backend: str = "torch") -> None:
    """Plan a prefix-cache sweep: one segment per chain over the flat ``slots`` (docs/ops-contract.md 3).

    ``slots`` is int64 ``[N]`` (verify it with ``table = slots.view(1, N)``); ``starts``, ``lens``,
    ``first_positions``, ``prev_slots`` and the optional ``expect_end`` are int64 ``[n]``; ``plan`` needs
    ``cap >= n`` rows.
    """
    device = slots.device if isinstance(slots, torch.Tensor) else torch.device("cpu")
    sl = check_tensor(slots, "slots", ndim=1)
    st = check_tensor(starts, "starts", ndim=1, device=device)
    n = st.shape[0]
    ln = check_tensor(lens, "lens", ndim=1, device=device, shape=(n,))
    fp = check_tensor(first_positions, "first_positions", ndim=1, device=device, shape=(n,))
    pv = check_tensor(prev_slots, "prev_slots", ndim=1, device=device, shape=(n,))
    ee = None if expect_end is None else check_tensor(expect_end, "expect_end", ndim=1, device=device, shape=(n,))
    p, s = check_plan_buffers(plan, status, device)
    if p.shape[0] < n:
        raise CanaryInputError(f"plan has {p.shape[0]} rows, sweep has {n} chains")
    b = check_backend(backend, device)
    if b == "torch":
        _plan_sweep_torch(p, s, sl.shape[0], st, ln, fp, pv, ee)
        return
    _native.module(b).plan_sweep(p, s, sl, st, ln, fp, pv, empty_i64(device) if ee is None else ee,
                                 int(ee is not None))


def _check_inv(inv: object, num_slot_ids: object, device: torch.device) -> tuple[torch.Tensor, int]:
    """The rolling sweep's inverse slot map (int64, at least ``num_slot_ids`` >= 1 entries) and that count."""
    iv = check_tensor(inv, "inv", ndim=1, device=device)
    m = check_scalar(num_slot_ids, "num_slot_ids", 1)
    if iv.shape[0] < m:
        raise CanaryInputError(f"inv has {iv.shape[0]} entries, needs num_slot_ids = {m}")
    return iv, m


def derive_roll(slots: torch.Tensor, lens: torch.Tensor, inv: torch.Tensor, ends: torch.Tensor, num_slot_ids: int,
                backend: str = "torch") -> None:
    """What :func:`plan_roll` needs of a new export, in one call (docs/ops-contract.md 3a): ``inv[slots[k]] = k`` for
    every ``k`` with ``0 <= slots[k] < num_slot_ids`` (one such ``k`` where an id repeats; every other entry of ``inv``
    is kept: plan_roll takes ``inv[s]`` only where ``slots[inv[s]] == s``) and ``ends`` (int64 ``[n]``, written) the
    running sum of ``max(lens, 0)`` (wrapping as int64 does)."""
    device = slots.device if isinstance(slots, torch.Tensor) else torch.device("cpu")
    sl = check_tensor(slots, "slots", ndim=1)
    ln = check_tensor(lens, "lens", ndim=1, device=device)
    en = check_tensor(ends, "ends", ndim=1, device=device, shape=(ln.shape[0],))
    iv, m = _check_inv(inv, num_slot_ids, device)
    b = check_backend(backend, device)
    if b == "torch":
        _derive_roll_torch(sl, ln, iv, en, m)
        return
    _native.module(b).derive_roll(sl, ln, iv, en, m)


def bind_plan_roll(plan: torch.Tensor, status: torch.Tensor, chain_out: torch.Tensor, slots: torch.Tensor,
                   starts: torch.Tensor, lens: torch.Tensor, ends: torch.Tensor, first_positions: torch.Tensor,
                   prev_slots: torch.Tensor, inv: torch.Tensor, num_slot_ids: int, *,
                   unlocked: torch.Tensor | None = None, backend: str = "torch") -> Callable[[int], None]:
    """:func:`plan_roll`'s arguments but the cursor checked once (an export's slices differ only in their cursor): a
    call that plans the slice from the cursor it is given."""
    device = slots.device if isinstance(slots, torch.Tensor) else torch.device("cpu")
    sl = check_tensor(slots, "slots", ndim=1)
    st = check_tensor(starts, "starts", ndim=1, device=device)
    n = st.shape[0]
    named = ((lens, "lens"), (ends, "ends"), (first_positions, "first_positions"), (prev_slots, "prev_slots"))
    ln, en, fp, pv = (check_tensor(t, name, ndim=1, device=device, shape=(n,)) for t, name in named)
    un = None if unlocked is None else check_tensor(unlocked, "unlocked", ndim=1, device=device, shape=(n,))
    co = check_tensor(chain_out, "chain_out", ndim=1, device=device)
    iv, m = _check_inv(inv, num_slot_ids, device)
    p, s = check_plan_buffers(plan, status, device)
    if p.shape[0] < co.shape[0]:
        raise CanaryInputError(f"plan has {p.shape[0]} rows, the slice has {co.shape[0]} entries")
    b = check_backend(backend, device)
    native = None if b == "torch" else _native.module(b).plan_roll
    tail = (empty_i64(device) if un is None else un, int(un is not None), iv, m)

    def run(cursor: int) -> None:
        if isinstance(cursor, bool) or not isinstance(cursor, int) or not 0 <= cursor < m:
            raise CanaryInputError(f"cursor must be an int in [0, {m}), got {cursor!r}")
        if native is None:
            _plan_roll_torch(p, s, co, sl, st, ln, en, fp, pv, un, iv, m, cursor)
        else:  # torch tensors, not pre-converted: tvm-ffi takes torch's current stream from them
            native(p, s, co, sl, st, ln, en, fp, pv, *tail, cursor)
    return run


def plan_roll(plan: torch.Tensor, status: torch.Tensor, chain_out: torch.Tensor, slots: torch.Tensor,
              starts: torch.Tensor, lens: torch.Tensor, ends: torch.Tensor, first_positions: torch.Tensor,
              prev_slots: torch.Tensor, inv: torch.Tensor, num_slot_ids: int, cursor: int, *,
              unlocked: torch.Tensor | None = None, backend: str = "torch") -> None:
    """Plan one rolling-sweep slice of ``W = len(chain_out)`` table slot ids from ``cursor`` (docs/ops-contract.md 3a).

    The export (``slots [N]``, per chain ``starts``, ``lens``, ``first_positions``, ``prev_slots`` and the optional
    ``unlocked``, int64 ``[n]``) comes with ``ends`` (running sum of ``max(lens, 0)``) and ``inv`` (int64
    ``[>= num_slot_ids]``: flat export index of each table slot, taken only where ``slots[inv[s]] == s``), both
    derived once per export (:func:`derive_roll`).
    Slice entry i becomes a one-slot sweep chain (or an empty one) and ``chain_out[i]`` its export chain (-1 = none);
    verify the plan with ``table = slots.view(1, N)``.
    """
    bind_plan_roll(plan, status, chain_out, slots, starts, lens, ends, first_positions, prev_slots, inv, num_slot_ids,
                   unlocked=unlocked, backend=backend)(cursor)


# ---- torch reference -------------------------------------------------------------------------------------------

def _excl_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


def _write_segments(plan: torch.Tensor, status: torch.Tensor, ok: torch.Tensor, rows: torch.Tensor,
                    write_len: torch.Tensor, input_errors: torch.Tensor, overflow: torch.Tensor) -> None:
    """Compact the ok rows (in order) to the top of ``plan`` and fill ``status``; no host sync."""
    vlen = rows[:, PlanCol.IDX_END] - rows[:, PlanCol.IDX_BEGIN]
    vlen = torch.where(ok, vlen, torch.zeros_like(vlen))
    rows[:, PlanCol.ENTRY_OFFSET] = _excl_cumsum(vlen)
    cap = plan.shape[0]
    # Rows that are not segments land in a spare row past the capacity (rows >= NUM_SEGMENTS are unspecified).
    dest = torch.where(ok, _excl_cumsum(ok.to(torch.int64)), torch.full_like(vlen, cap))
    staged = torch.zeros(cap + 1, NUM_PLAN_COLS, dtype=torch.int64, device=plan.device)
    staged[:cap] = plan
    staged.index_copy_(0, dest, rows)
    plan.copy_(staged[:cap])
    status[PlanStatusCol.NUM_SEGMENTS] = ok.sum()
    status[PlanStatusCol.VERIFY_ENTRIES] = vlen.sum()
    status[PlanStatusCol.WRITE_ENTRIES] = torch.where(ok, write_len, torch.zeros_like(write_len)).sum()
    status[PlanStatusCol.INPUT_ERRORS] = input_errors
    status[PlanStatusCol.OVERFLOW] = overflow


def _flag(mask: torch.Tensor, bit: PlanFlag) -> torch.Tensor:
    return mask.to(torch.int64) * int(bit)


def _plan_forward_torch_with_reuse(plan: torch.Tensor, status: torch.Tensor, rpi: torch.Tensor, pre: torch.Tensor,
                                   ext: torch.Tensor, table: torch.Tensor, num_tokens: int, window: int,
                                   padding_row: int, expect_prefix: torch.Tensor | None,
                                   expect_new: torch.Tensor | None, flag_mask: torch.Tensor | None, page: int,
                                   reuse_plan: torch.Tensor, reuse_status: torch.Tensor,
                                   reuse_lens: torch.Tensor | None, tick: torch.Tensor) -> None:
    """The forward plan, then (``reuse_lens`` given) the reuse plan: window 0, no new tokens, no expectations, no flag
    mask; then the stage counter ``tick`` += 1."""
    _plan_forward_torch(plan, status, rpi, pre, ext, table, num_tokens, window, padding_row, expect_prefix, expect_new,
                        flag_mask, page)
    if reuse_lens is not None:
        _plan_forward_torch(reuse_plan, reuse_status, rpi, reuse_lens, torch.zeros_like(reuse_lens), table, num_tokens,
                            0, padding_row, None, None, None, page)
    tick.add_(1)


def _plan_forward_torch(plan: torch.Tensor, status: torch.Tensor, rpi: torch.Tensor, pre: torch.Tensor,
                        ext: torch.Tensor, table: torch.Tensor, num_tokens: int, window: int, padding_row: int,
                        expect_prefix: torch.Tensor | None, expect_new: torch.Tensor | None,
                        flag_mask: torch.Tensor | None, page: int) -> None:
    num_rows, stride = table.shape
    row_len = stride * page
    cap_tok = num_tokens + 1
    # Running offset capped at num_tokens + 1 (csrc/core/plan.cuh, plan_token_term): no wrap, same outcomes.
    wb = torch.clamp(_excl_cumsum(torch.clamp(ext, 0, cap_tok)), max=cap_tok)
    pad = (rpi == padding_row) if padding_row >= 0 else torch.zeros_like(rpi, dtype=torch.bool)
    valid = (~pad & (rpi >= 0) & (rpi < num_rows) & (pre >= 0) & (ext >= 0) & (pre <= row_len)
             & (ext <= row_len - pre))
    over = valid & (ext > num_tokens - wb)
    # padding rows whose tokens lie inside the batch get a PADDING segment (csrc/core/plan.cuh)
    pad_seg = pad & (rpi < num_rows) & (ext > 0) & (ext <= num_tokens - wb)
    ok = (valid & ~over) | pad_seg
    req = ok & ~pad_seg
    vb = torch.clamp(pre - window, min=0) if window > 0 else torch.zeros_like(pre)
    vb = torch.where(req, vb, torch.zeros_like(vb))
    pre_ok = torch.where(req, pre, torch.zeros_like(pre))
    row_ok = torch.where(req, rpi, torch.zeros_like(rpi))
    flat = table.reshape(-1).to(torch.int64)

    def at(idx: torch.Tensor) -> torch.Tensor:  # table[row, idx] where idx >= 0, else NO_SLOT
        if not flat.numel():
            return torch.full_like(idx, NO_SLOT)
        got = table_slots(flat, stride, page, row_ok, torch.clamp(idx, min=0))
        return torch.where(idx >= 0, got, torch.full_like(got, NO_SLOT))

    rows = torch.zeros(rpi.shape[0], NUM_PLAN_COLS, dtype=torch.int64, device=rpi.device)
    rows[:, PlanCol.BATCH_INDEX] = torch.arange(rpi.shape[0], device=rpi.device)
    rows[:, PlanCol.ROW] = rpi
    rows[:, PlanCol.IDX_BEGIN] = vb
    rows[:, PlanCol.IDX_END] = pre_ok
    rows[:, PlanCol.FIRST_PREV_SLOT] = at(vb - 1)
    rows[:, PlanCol.WRITE_BEGIN] = wb
    rows[:, PlanCol.WRITE_LEN] = ext
    rows[:, PlanCol.SEED_SLOT] = at(pre_ok - 1)
    rows[:, PlanCol.PREFIX_LEN] = pre
    flags = _flag(vb == 0, PlanFlag.FIRST_IS_HEAD) | _flag(pre_ok == 0, PlanFlag.SEED_IS_HEAD)
    if expect_prefix is not None:
        rows[:, PlanCol.EXPECT_PREFIX] = torch.where(pad_seg, 0, expect_prefix)
        flags |= _flag(~pad_seg, PlanFlag.EXPECT_PREFIX)
    if expect_new is not None:
        rows[:, PlanCol.EXPECT_NEW] = torch.where(pad_seg, 0, expect_new)
        flags |= _flag(~pad_seg, PlanFlag.EXPECT_NEW)
    rows[:, PlanCol.FLAGS] = flags | _flag(pad_seg, PlanFlag.PADDING)
    if flag_mask is not None:
        rows[:, PlanCol.FLAGS] &= flag_mask
    errors = (~pad & ~valid).sum() + over.sum()
    _write_segments(plan, status, ok, rows, ext, errors, over.any().to(torch.int64))


def _plan_sweep_torch(plan: torch.Tensor, status: torch.Tensor, n_slots: int, starts: torch.Tensor,
                      lens: torch.Tensor, first_positions: torch.Tensor, prev_slots: torch.Tensor,
                      expect_end: torch.Tensor | None) -> None:
    ok = ((starts >= 0) & (lens >= 0) & (starts <= n_slots) & (lens <= n_slots - starts) & (first_positions >= 0))
    n = starts.shape[0]
    rows = torch.zeros(n, NUM_PLAN_COLS, dtype=torch.int64, device=starts.device)
    rows[:, PlanCol.BATCH_INDEX] = torch.arange(n, device=starts.device)
    rows[:, PlanCol.IDX_BEGIN] = starts
    rows[:, PlanCol.IDX_END] = torch.where(ok, starts + lens, starts)
    rows[:, PlanCol.POS_SHIFT] = first_positions - starts
    rows[:, PlanCol.FIRST_PREV_SLOT] = prev_slots
    rows[:, PlanCol.SEED_SLOT] = NO_SLOT
    rows[:, PlanCol.PREFIX_LEN] = first_positions + lens
    flags = _flag(prev_slots == NO_SLOT, PlanFlag.FIRST_IS_HEAD)
    if expect_end is not None:
        rows[:, PlanCol.EXPECT_PREFIX] = expect_end
        flags |= int(PlanFlag.EXPECT_PREFIX)
    rows[:, PlanCol.FLAGS] = flags
    zero = torch.zeros((), dtype=torch.int64, device=starts.device)
    _write_segments(plan, status, ok, rows, torch.zeros_like(lens), (~ok).sum(), zero)


def _first_past(ends: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Per k, the first index with ends > k (len(ends) if none) by the same binary search as csrc/core/plan.cuh, so
    that non-monotone ``ends`` give the same (unspecified) chain in every backend."""
    lo, hi = torch.zeros_like(k), torch.full_like(k, ends.shape[0])
    while True:
        active = lo < hi
        if not bool(active.any()):
            return lo
        mid = lo + (hi - lo) // 2
        past = ends[mid.clamp(max=ends.shape[0] - 1)] > k
        hi = torch.where(active & past, mid, hi)
        lo = torch.where(active & ~past, mid + 1, lo)


def _derive_roll_torch(slots: torch.Tensor, lens: torch.Tensor, inv: torch.Tensor, ends: torch.Tensor, m: int) -> None:
    """No host sync: ids outside [0, m) go to a spare entry past a copy of inv[:m]."""
    idx = torch.where((slots >= 0) & (slots < m), slots, m)
    full = torch.cat([inv[:m], inv.new_zeros(1)])
    full.index_copy_(0, idx, torch.arange(slots.shape[0], dtype=torch.int64, device=slots.device))
    inv[:m].copy_(full[:m])
    ends.copy_(torch.cumsum(lens.clamp(min=0), 0))


def _plan_roll_torch(plan: torch.Tensor, status: torch.Tensor, chain_out: torch.Tensor, slots: torch.Tensor,
                     starts: torch.Tensor, lens: torch.Tensor, ends: torch.Tensor, first_positions: torch.Tensor,
                     prev_slots: torch.Tensor, unlocked: torch.Tensor | None, inv: torch.Tensor, m: int,
                     cursor: int) -> None:
    d, n, big = slots.device, starts.shape[0], slots.shape[0]
    ids = (cursor + torch.arange(chain_out.shape[0], dtype=torch.int64, device=d)) % m
    k = inv[ids]
    ok = (k >= 0) & (k < big) & (n > 0)
    kc = torch.where(ok, k, 0)
    if big:
        ok &= slots[kc] == ids
    chain = _first_past(ends, kc) if n else torch.zeros_like(k)
    ok &= chain < n
    c = chain.clamp(max=max(n - 1, 0))

    def at(t: torch.Tensor) -> torch.Tensor:  # t[c] (zeros when there is no chain)
        return t[c] if n else torch.zeros_like(k)
    start = at(starts)
    ok &= (start >= 0) & (start == at(ends) - at(lens).clamp(min=0)) & (kc >= start)
    if unlocked is not None and n:
        ok &= unlocked[c] != 0
    kc = torch.where(ok, k, 0)
    off = kc - start
    prev = torch.where(off > 0, slots[(kc - 1).clamp(min=0)] if big else kc, at(prev_slots))
    chain_out.copy_(torch.where(ok, c, -1))
    _plan_sweep_torch(plan, status, big, kc, ok.to(torch.int64), torch.where(ok, at(first_positions) + off, 0),
                      torch.where(ok, prev, NO_SLOT), None)
