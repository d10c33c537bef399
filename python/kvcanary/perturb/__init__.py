"""Seeded self-test perturbations: each corrupts one thing and names the check (FailReason, stage) catching it."""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from kvcanary_schema import (
    FailReason,
    FingerprintMode,
    FpSourceCol,
    Group,
    Half,
    LaunchTag,
    RecordField,
    Stage,
)

from kvcanary.adapter import BatchView, PrefixCacheExport, TransferBuffer
from kvcanary.config import PerturbConfig, PerturbMode
from kvcanary.errors import CanaryInputError, KVCanaryInternalError
from kvcanary.ops.fingerprint import hashed_bytes
from kvcanary.state import CanaryState, GroupState

logger = logging.getLogger("kvcanary")


@dataclass(frozen=True)
class Expectation:
    """The check that must catch a perturbation: a FailReason under a stage, and when."""

    reason: FailReason
    stage: Stage
    when: str  # "this forward", "next forward of the request", "next sweep", "receiver's first forward"
    needs: str = ""  # configuration the detection depends on


# The table: every mode -> what must catch it (DESIGN 9). Token truth is needed where ``needs`` says so.
EXPECTED: dict[PerturbMode, Expectation] = {
    PerturbMode.REQ_TO_TOKEN: Expectation(FailReason.VERIFY_CHAIN, Stage.HEAD, "this forward"),
    PerturbMode.REAL_KV_USED: Expectation(FailReason.VERIFY_FINGERPRINT, Stage.TAIL, "this forward", "fingerprint"),
    PerturbMode.REAL_KV_UNUSED_CACHED: Expectation(FailReason.VERIFY_FINGERPRINT, Stage.SWEEP, "next sweep",
                                                   "fingerprint, sweep"),
    PerturbMode.REAL_KV_POST_FORWARD: Expectation(FailReason.VERIFY_FINGERPRINT, Stage.TAIL,
                                                  "next forward of the request", "fingerprint"),
    PerturbMode.NEXT_TOKEN_SWAP: Expectation(FailReason.WRITE_TOKEN, Stage.HEAD, "this forward", "token truth"),
    PerturbMode.SLOT_SWAP: Expectation(FailReason.VERIFY_TOKEN, Stage.HEAD, "this forward", "token truth"),
    PerturbMode.USE_AFTER_FREE: Expectation(FailReason.VERIFY_CHAIN, Stage.HEAD, "next forward of the request"),
    PerturbMode.RECORD_FLIP: Expectation(FailReason.VERIFY_CHAIN, Stage.HEAD, "this forward (stage of the buffer)"),
    PerturbMode.MULTI_BIT_FLIP: Expectation(FailReason.VERIFY_FINGERPRINT, Stage.TAIL, "this forward", "fingerprint"),
    PerturbMode.TRANSFER_CORRUPTION: Expectation(FailReason.VERIFY_CHAIN, Stage.TAIL, "receiver's first forward"),
}
_NEEDS_FP = {PerturbMode.REAL_KV_USED, PerturbMode.REAL_KV_UNUSED_CACHED, PerturbMode.REAL_KV_POST_FORWARD,
             PerturbMode.MULTI_BIT_FLIP}


@dataclass
class PerturbEvent:
    """What one perturbation did, and the launch tag that must report it."""

    mode: PerturbMode
    step: int
    tag: LaunchTag
    reason: FailReason
    detail: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """One log line."""
        kv = " ".join(f"{k}={v}" for k, v in self.detail.items())
        return (f"kvcanary perturb {self.mode.value}: step={self.step} {kv} -> expect {self.reason.name} "
                f"@ {self.tag.name}")


class Perturber:
    """Applies the configured perturbations (seeded; nothing before ``warmup_steps``; per-mode probability)."""

    def __init__(self, state: CanaryState, config: PerturbConfig, fp_mode: FingerprintMode) -> None:
        self.state = state
        self.config = config
        self.rng = random.Random(config.seed)
        self.events: list[PerturbEvent] = []
        for mode in _NEEDS_FP:
            if config.probability(mode) > 0 and fp_mode == FingerprintMode.NONE:
                raise CanaryInputError(f"perturb mode {mode.value} needs CanaryConfig.fingerprint != none")
        self._warm_logged = False
        self.enabled = config.enabled  # the config is frozen: the bracket skips the hooks when no mode can fire

    def wants_export(self) -> bool:
        """True when a sweep step needs the prefix-cache export (unused-cached mode)."""
        return self.config.probability(PerturbMode.REAL_KV_UNUSED_CACHED) > 0

    def _fire(self, mode: PerturbMode, step: int) -> bool:
        p = self.config.probability(mode)
        if p <= 0:
            return False
        if step <= self.config.warmup_steps:
            return False
        if not self._warm_logged:
            logger.info("kvcanary perturbation enabled from step %d (seed %d)", step, self.config.seed)
            self._warm_logged = True
        return self.rng.random() < p

    def _record(self, ev: PerturbEvent | None) -> PerturbEvent | None:
        if ev is not None:
            self.events.append(ev)
            logger.info(ev.describe())
        return ev

    # ---------------------------------------------------------------- hooks

    def before_forward(self, batch: BatchView, step: int, export: PrefixCacheExport | None) -> list[PerturbEvent]:
        """Perturbations that happen before the forward (outside any graph)."""
        out: list[PerturbEvent] = []
        if not self.enabled:
            return out
        actions = [(PerturbMode.REQ_TO_TOKEN, self.req_to_token), (PerturbMode.REAL_KV_USED, self.real_kv_used),
                   (PerturbMode.MULTI_BIT_FLIP, self.multi_bit_flip),
                   (PerturbMode.NEXT_TOKEN_SWAP, self.next_token_swap),
                   (PerturbMode.SLOT_SWAP, self.slot_swap), (PerturbMode.USE_AFTER_FREE, self.use_after_free),
                   (PerturbMode.RECORD_FLIP, self.record_flip)]
        for mode, fn in actions:
            if self._fire(mode, step):
                ev = self._record(fn(batch, step))
                if ev is not None:
                    out.append(ev)
        if export is not None and self._fire(PerturbMode.REAL_KV_UNUSED_CACHED, step):
            ev = self._record(self.real_kv_unused_cached(export, step))
            if ev is not None:
                out.append(ev)
        return out

    def after_forward(self, batch: BatchView, step: int) -> PerturbEvent | None:
        """Perturbations right after the forward (after the TAIL write)."""
        if self._fire(PerturbMode.REAL_KV_POST_FORWARD, step):
            return self._record(self.real_kv_post_forward(batch, step))
        return None

    def on_transfer(self, buffers: Sequence[TransferBuffer], slots: torch.Tensor, step: int = 0) -> PerturbEvent | None:
        """Called by a transfer with the buffers in transit and the sent slots: maybe corrupt one record."""
        if self._fire(PerturbMode.TRANSFER_CORRUPTION, step):
            return self._record(self.transfer_corruption(buffers, slots, step))
        return None

    # ---------------------------------------------------------------- modes

    def req_to_token(self, batch: BatchView, step: int) -> PerturbEvent | None:
        """Point one prefix entry of a request at another used slot (a stale/wrong slot table entry)."""
        reqs = self._with_prefix(batch)
        if not reqs:
            return None
        i = self.rng.choice(reqs)
        row, pre = batch.req_pool_indices_host[i], batch.prefix_lens_host[i]
        idx = self.rng.randrange(pre)
        rt = batch.req_to_token
        old = int(rt[row, idx])
        cands = [(batch.req_pool_indices_host[j], k) for j in reqs for k in range(batch.prefix_lens_host[j])
                 if k != idx and int(rt[batch.req_pool_indices_host[j], k]) != old]
        if not cands:
            return None
        r2, k2 = self.rng.choice(cands)
        new = int(rt[r2, k2])
        rt[row, idx] = new
        return self._event(PerturbMode.REQ_TO_TOKEN, step, Half.K, self._first_group(),
                           {"row": row, "index": idx, "old_slot": old, "new_slot": new})

    def real_kv_used(self, batch: BatchView, step: int) -> PerturbEvent | None:
        """XOR 0xFF into one hashed byte of the real KV of a slot a running request reads."""
        return self._kv_of_prefix(batch, step, PerturbMode.REAL_KV_USED, multi=False)

    def multi_bit_flip(self, batch: BatchView, step: int) -> PerturbEvent | None:
        """Flip 2..7 low mantissa bits of one element (never NaN/Inf) of a used slot's real KV."""
        return self._kv_of_prefix(batch, step, PerturbMode.MULTI_BIT_FLIP, multi=True)

    def real_kv_unused_cached(self, export: PrefixCacheExport, step: int) -> PerturbEvent | None:
        """Corrupt the real KV of a cached slot no running request holds (only a sweep can see it)."""
        n = export.num_chains
        starts, lens, firsts = export.starts.tolist(), export.lens.tolist(), export.first_positions.tolist()
        unlocked = export.unlocked.tolist() if export.unlocked is not None else [True] * n
        chains = [c for c in range(n) if unlocked[c] and lens[c] > 0]
        if not chains:
            return None
        c = self.rng.choice(chains)
        r = self.rng.randrange(lens[c])
        slot = int(export.slots[starts[c] + r])
        g = self._fp_group(slot)
        if g is None:
            return None
        detail = self._flip_kv(g, slot, firsts[c] + r, multi=False)
        if detail is None:
            return None
        return self._event(PerturbMode.REAL_KV_UNUSED_CACHED, step, Half(detail["half"]), g.spec.group,
                           {"chain": c, **detail}, Stage.SWEEP)

    def real_kv_post_forward(self, batch: BatchView, step: int) -> PerturbEvent | None:
        """Corrupt the real KV of a slot written by this forward (caught by its next reader)."""
        locs, poss = batch.out_cache_loc.tolist(), batch.positions.tolist()
        ks = [k for k, s in enumerate(locs) if s >= 0]
        self.rng.shuffle(ks)
        for k in ks:
            g = self._fp_group(locs[k])
            if g is None:
                continue
            detail = self._flip_kv(g, locs[k], poss[k], multi=False)
            if detail is not None:
                return self._event(PerturbMode.REAL_KV_POST_FORWARD, step, Half(detail["half"]), g.spec.group,
                                   detail)
        return None

    def next_token_swap(self, batch: BatchView, step: int) -> PerturbEvent | None:
        """Swap the new tokens of two requests (the scheduler fed the wrong previous token)."""
        ids = batch.input_ids
        starts, off = [], 0
        for i, e in enumerate(batch.extend_lens_host):
            if e > 0 and batch.request_ids[i] is not None:
                starts.append(off + e - 1)
            off += max(0, e)
        pairs = [(a, b) for ai, a in enumerate(starts) for b in starts[ai + 1:] if int(ids[a]) != int(ids[b])]
        if not pairs:
            return None
        a, b = self.rng.choice(pairs)
        ta, tb = int(ids[a]), int(ids[b])
        ids[a], ids[b] = tb, ta
        return self._event(PerturbMode.NEXT_TOKEN_SWAP, step, Half.K, self._first_group(),
                           {"token_index_a": a, "token_index_b": b, "tokens": (ta, tb)})

    def slot_swap(self, batch: BatchView, step: int) -> PerturbEvent | None:
        """Swap the whole prefix slot lists of two requests of equal prefix length (self-consistent chains)."""
        reqs = self._with_prefix(batch)
        rt = batch.req_to_token
        pairs = []
        for ai, a in enumerate(reqs):
            for b in reqs[ai + 1:]:
                ra, rb = batch.req_pool_indices_host[a], batch.req_pool_indices_host[b]
                pa = batch.prefix_lens_host[a]
                if ra != rb and pa == batch.prefix_lens_host[b] and not torch.equal(rt[ra, :pa], rt[rb, :pa]):
                    pairs.append((ra, rb, pa))
        if not pairs:
            return None
        ra, rb, p = self.rng.choice(pairs)
        tmp = rt[ra, :p].clone()
        rt[ra, :p] = rt[rb, :p]
        rt[rb, :p] = tmp
        return self._event(PerturbMode.SLOT_SWAP, step, Half.K, self._first_group(),
                           {"row_a": ra, "row_b": rb, "prefix_len": p})

    def use_after_free(self, batch: BatchView, step: int) -> PerturbEvent | None:
        """Hand a slot still used by request A to request B's new token (B's write lands on A's KV)."""
        holders = self._with_prefix(batch)
        off, writers = 0, []
        for i, e in enumerate(batch.extend_lens_host):
            if e > 0 and batch.request_ids[i] is not None:
                writers.append((i, off + e - 1))
            off += max(0, e)
        cands = [(a, b, k) for a in holders for b, k in writers if a != b]
        if not cands:
            return None
        a, b, k = self.rng.choice(cands)
        row_a, row_b = batch.req_pool_indices_host[a], batch.req_pool_indices_host[b]
        idx = self.rng.randrange(batch.prefix_lens_host[a])
        slot = int(batch.req_to_token[row_a, idx])
        pos_b = int(batch.positions[k])
        old = int(batch.out_cache_loc[k])
        batch.out_cache_loc[k] = slot
        batch.req_to_token[row_b, pos_b] = slot
        return self._event(PerturbMode.USE_AFTER_FREE, step, Half.K, self._first_group(),
                           {"victim_row": row_a, "victim_index": idx, "slot": slot, "writer_row": row_b,
                            "writer_position": pos_b, "leaked_slot": old})

    def record_flip(self, batch: BatchView, step: int) -> PerturbEvent | None:
        """Flip one bit of a canary record's prev_hash (HEAD or TAIL buffer) of a used slot."""
        reqs = self._with_prefix(batch)
        if not reqs:
            return None
        i = self.rng.choice(reqs)
        row = batch.req_pool_indices_host[i]
        idx = self.rng.randrange(batch.prefix_lens_host[i])
        t = int(batch.req_to_token[row, idx])
        g = self._resident_group(t)
        if g is None:
            return None
        stage = self.rng.choice([Stage.HEAD, Stage.TAIL])
        half = self.rng.randrange(g.spec.halves)
        gslot = self._gslot(g, t)
        bit = self.rng.randrange(64)
        rec = g.views(stage).records
        rec[gslot, half, RecordField.PREV_HASH] ^= _bit64(bit)
        return self._event(PerturbMode.RECORD_FLIP, step, Half(half), g.spec.group,
                           {"row": row, "index": idx, "slot": gslot, "stage": stage.name, "bit": bit}, stage)

    def transfer_corruption(self, buffers: Sequence[TransferBuffer], slots: torch.Tensor,
                            step: int) -> PerturbEvent | None:
        """Flip one bit of a TAIL record's prev_hash among the slots in transit."""
        tails = [(n, t) for n, t in buffers if n.endswith(".tail") and t.dim() == 3]
        sl = [s for s in slots.tolist() if s >= 0]
        if not tails or not sl:
            return None
        name, t = self.rng.choice(tails)
        s = self.rng.choice(sl)
        half = self.rng.randrange(t.shape[1])
        bit = self.rng.randrange(64)
        t[s, half, RecordField.PREV_HASH] ^= _bit64(bit)
        group = Group.SWA if ".swa." in name else Group.FULL
        return self._event(PerturbMode.TRANSFER_CORRUPTION, step, Half(half), group,
                           {"buffer": name, "slot": s, "bit": bit}, Stage.TAIL)

    # ---------------------------------------------------------------- helpers

    def _event(self, mode: PerturbMode, step: int, half: Half, group: Group, detail: dict[str, Any],
               stage: Stage | None = None) -> PerturbEvent:
        exp = EXPECTED[mode]
        return PerturbEvent(mode, step, LaunchTag.of(stage if stage is not None else exp.stage, half, group),
                            exp.reason, detail)

    @staticmethod
    def _with_prefix(batch: BatchView) -> list[int]:
        return [i for i in range(batch.batch_size)
                if batch.request_ids[i] is not None and batch.prefix_lens_host[i] > 0]

    def _first_group(self) -> Group:
        return self.state.groups[0].spec.group

    def _gslot(self, g: GroupState, t: int) -> int:
        return t if g.spec.swa_map is None else int(g.spec.swa_map[t])

    def _resident_group(self, t: int) -> GroupState | None:
        for g in self.state.groups:
            s = self._gslot(g, t)
            if s >= g.spec.reserved_slots:
                return g
        return None

    def _fp_group(self, t: int) -> GroupState | None:
        for g in self.state.groups:
            if g.fingerprint is not None and self._gslot(g, t) >= g.spec.reserved_slots:
                return g
        return None

    def _kv_of_prefix(self, batch: BatchView, step: int, mode: PerturbMode, multi: bool) -> PerturbEvent | None:
        reqs = self._with_prefix(batch)
        new = set(batch.out_cache_loc.tolist())
        self.rng.shuffle(reqs)
        for i in reqs:
            row, pre = batch.req_pool_indices_host[i], batch.prefix_lens_host[i]
            idx = self.rng.randrange(pre)
            t = int(batch.req_to_token[row, idx])
            if t in new:
                continue
            g = self._fp_group(t)
            if g is None:
                continue
            detail = self._flip_kv(g, t, idx, multi)
            if detail is not None:
                return self._event(mode, step, Half(detail["half"]), g.spec.group, {"row": row, "index": idx, **detail})
        return None

    def _flip_kv(self, g: GroupState, t: int, position: int, multi: bool) -> dict[str, Any] | None:
        """Flip bytes of table slot ``t`` in a source the fingerprint hashes at ``position``."""
        fp = g.fingerprint
        if fp is None:
            raise KVCanaryInternalError("fp is unset: an invariant of the bracket was broken")
        gslot = self._gslot(g, t)
        if gslot < g.spec.reserved_slots:
            return None
        srcs = fp.sources
        hashed = [j for j in range(srcs.num_sources) if (j + position) % fp.layer_stride == 0]
        if not hashed:
            return None
        meta = srcs.table.tolist()
        # (half, source) pairs whose hashed bytes include some at this position (HalfCoverage.FIRST: not V's)
        pairs = [(h, j) for h in range(len(srcs.halves)) for j in hashed
                 if hashed_bytes(meta[h][j][FpSourceCol.READ_BYTES], fp.mode) > 0]
        if not pairs:
            return None
        half, j = self.rng.choice(pairs)
        spec = srcs.halves[half][j]
        page, bpt = meta[half][j][FpSourceCol.PAGE_SIZE], meta[half][j][FpSourceCol.BYTES_PER_TOKEN]
        span = hashed_bytes(meta[half][j][FpSourceCol.READ_BYTES], fp.mode)
        rows = srcs.rows[half][j]
        base = (gslot % page) * bpt
        es = spec.tensor.element_size()
        if multi:
            off = base + self.rng.randrange(max(1, span // es)) * es  # lowest byte of an element: mantissa bits
            bits = self.rng.sample(range(7), self.rng.randint(2, 7))
            mask = sum(1 << b for b in bits)
        else:
            off, mask = base + self.rng.randrange(span), 0xFF
        before = int(rows[gslot // page, off])
        rows[gslot // page, off] = before ^ mask
        return {"group": g.spec.group.name, "half": half, "source": j, "slot": gslot, "byte": off,
                "before": f"0x{before:02x}", "after": f"0x{before ^ mask:02x}"}


def _bit64(bit: int) -> int:
    """int64 value with one bit set (bit 63 is the sign bit)."""
    return -(1 << 63) if bit == 63 else 1 << bit
