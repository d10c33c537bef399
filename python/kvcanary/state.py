"""Device state allocated once at install: records, plans, sink, static batch buffers, token pool."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from kvcanary_schema import (
    NUM_COUNTER_COLS,
    NUM_LAUNCH_TAGS,
    NUM_PLAN_COLS,
    NUM_PLAN_STATUS_COLS,
    NUM_VIOLATION_COLS,
    RECORD_NUM_FIELDS,
    FingerprintMode,
    Group,
    Stage,
    TokenTruth,
)

from kvcanary.adapter import GroupSpec, PoolDescription, TransferBuffer
from kvcanary.config import CanaryConfig, CoveragePolicy, HalfCoverage, LayerCoverage
from kvcanary.errors import CanaryInputError
from kvcanary.ops.types import Fingerprint, FingerprintSources, GroupView, Sink, TokenPool
from kvcanary.ops.write import takes_carries, write_carries, write_workspace

UPLOAD_ROWS = 5  # rows of CanaryState.truth_rows


def _i64(*shape: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.int64, device=device)


@dataclass
class GroupState:
    """One pool group's canary state: HEAD and TAIL records, plans and fingerprint."""

    spec: GroupSpec
    head: GroupView
    tail: GroupView
    # the HEAD and TAIL record buffers in one tensor [2, num_slots, H, F] (``head.records`` / ``tail.records``): one
    # invalidate call poisons a freed slot in both
    records: torch.Tensor
    plan: torch.Tensor  # int64 [req_capacity, NUM_PLAN_COLS]
    status: torch.Tensor  # int64 [NUM_PLAN_STATUS_COLS]
    stripe_plan: torch.Tensor | None  # WINDOW policy (FULL group): the rotating stripe of older slots
    stripe_status: torch.Tensor | None
    fingerprint: Fingerprint | None
    seal: Fingerprint | None = None  # every byte of every source, stored in the HEAD records (config.sealing)
    reuse_plan: torch.Tensor | None = None  # reuse check: each new request's reused prefix, against the seal
    reuse_status: torch.Tensor | None = None
    # per write op (HEAD write or seal, TAIL write): its own look-back workspace (ops.write.write_workspace; cuda
    # backend only, none for the others)
    write_workspaces: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    # the chain carries the pre stage's HEAD write keeps for the TAIL write (ops.write.write_carries; cuda backend,
    # where the TAIL write can take them: ops.write.takes_carries)
    write_carries: torch.Tensor | None = None

    @property
    def window(self) -> int:
        """Window handed to plan_forward for the per-forward verify range."""
        return self.spec.window

    def views(self, stage: Stage) -> GroupView:
        """Records of a stage (SWEEP reuses TAIL)."""
        return self.head if stage == Stage.HEAD else self.tail


class CanaryState:
    """Every device buffer of one installed canary; sizes are fixed here and never change."""

    def __init__(self, pool: PoolDescription, config: CanaryConfig, backend: str = "torch") -> None:
        """Every buffer of ``pool`` under ``config``; ``backend`` (the checked one the ops run on) decides which
        backend-only scratch exists (the CUDA write's look-back workspaces)."""
        pool.validate()
        self.device = pool.resolved_device
        self.pool = pool
        self.config = config
        self.backend = backend
        d = self.device
        rc, tc = config.req_capacity, config.token_capacity
        # every group's forward-plan status, one row each: the post stage folds them all into the window's running
        # maximum with one bookkeep
        self.plan_status = _i64(len(pool.groups), NUM_PLAN_STATUS_COLS, device=d)
        self.groups: list[GroupState] = [self._group(spec, st) for spec, st in zip(pool.groups, self.plan_status,
                                                                                   strict=True)]
        # One arena so that staging a window is one copy and resetting it one fill:
        # [step | phase (pre, post) | counters | ring count | window status | ring rows]. Step and the pre-forward
        # phase are advanced by one add; everything after step is staged; ring count + window status are reset.
        n_ctr, n_ws = NUM_LAUNCH_TAGS * NUM_COUNTER_COLS, len(self.groups) * NUM_PLAN_STATUS_COLS
        self.arena = _i64(3 + n_ctr + 1 + n_ws + config.ring_capacity * NUM_VIOLATION_COLS, device=d)
        o = 3 + n_ctr
        self.snapshot = self.arena[1:]  # what a window stages: its head, then the ring rows
        self.window_head = self.arena[1:o + 1 + n_ws]
        self.pre_tick = self.arena[0:2]  # step, pre-forward phase
        self.post_tick = self.arena[2:3]  # post-forward phase
        self.reset_span = self.arena[o:o + 1 + n_ws]  # ring count + window status
        self.sink = Sink(self.arena[o + 1 + n_ws:].view(config.ring_capacity, NUM_VIOLATION_COLS),
                         self.arena[o:o + 1], self.arena[3:o].view(NUM_LAUNCH_TAGS, NUM_COUNTER_COLS),
                         self.arena[0:1])
        self.sink.validate(d)
        # pre-forward count [0] and post-forward count [1]: advanced inside the (captured) bracket
        self.phase = self.arena[1:3]
        # CUDA: (post-forward phase, ring count) mirrored by the post stage's last kernel into pinned host memory
        self.alarm = torch.zeros(2, dtype=torch.int64, pin_memory=d.type == "cuda")
        # a running max of plan status over the reporting window (input errors, overflow)
        self.window_status = self.arena[o + 1:o + 1 + n_ws].view(len(self.groups), NUM_PLAN_STATUS_COLS)
        # static batch buffers, filled by one stage_batch per forward: the bracket's device parts read only these.
        # Ops run at shapes past the batch (DeviceProgram.bound_shape): rows past it are padding rows and
        # tokens past it are never written (Upload.begin keeps that so), which is how they start
        self.batch_rows = _i64(3, rc, device=d)
        self.batch_rows[0].fill_(pool.padding_row)
        self.req_pool_indices, self.prefix_lens, self.extend_lens = self.batch_rows.unbind(0)
        # host-computed per-request rows, uploaded in one copy: expect_prefix, expect_new, flag mask, stripe end,
        # reuse end (the reused prefix a new request's first forward verifies against the seal; 0 = none)
        self.truth_rows = _i64(UPLOAD_ROWS, rc, device=d)
        self.expect_prefix, self.expect_new, self.flag_mask, self.stripe_end, self.reuse_end = self.truth_rows.unbind(0)
        self.flag_mask.fill_(-1)  # per request: PlanFlag bits kept
        self.batch_tokens = _i64(3, tc, device=d)
        self.batch_tokens[2].fill_(-1)
        self.input_ids, self.positions, self.out_cache_loc = self.batch_tokens.unbind(0)
        # WINDOW policy scratch
        self.arange = torch.arange(rc, dtype=torch.int64, device=d)
        self.zeros = _i64(rc, device=d)
        self.stripe_a = _i64(rc, device=d)
        self.stripe_b = _i64(rc, device=d)
        self.sweep_plan = _i64(config.sweep_capacity, NUM_PLAN_COLS, device=d)
        self.sweep_status = _i64(NUM_PLAN_STATUS_COLS, device=d)
        self.token_pool: TokenPool | None = None
        if config.token_truth == TokenTruth.POOL:
            width = pool.max_context + pool.token_offset
            self.token_pool = TokenPool(_i64(pool.req_rows, width, device=d), _i64(pool.req_rows, device=d),
                                        pool.token_offset)
            self.scatter_status = _i64(1, device=d)
        pin = d.type == "cuda"
        self.upload = [torch.zeros(UPLOAD_ROWS, rc, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        # rolling sweep: table slot -> flat export index (ops.plan.derive_roll)
        self.sweep_inv = _i64(pool.num_slots, device=d)

    def _group(self, spec: GroupSpec, status: torch.Tensor) -> GroupState:
        d, cfg = self.device, self.config
        swa_map = spec.swa_map if spec.group == Group.SWA else None
        records = _i64(2, spec.num_slots, spec.halves, RECORD_NUM_FIELDS, device=d)
        head, tail = (GroupView(rows, spec.group, spec.reserved_slots, swa_map) for rows in records)
        fp = None
        if cfg.fingerprint.value != 0:
            if spec.sources is None:
                raise CanaryInputError(f"fingerprint {cfg.fingerprint.name} needs real-KV sources for group "
                                       f"{spec.group.name} (GroupSpec.sources)")
            halves = [list(h[:1]) if cfg.layer_coverage == LayerCoverage.FIRST else list(h) for h in spec.sources]
            if cfg.half_coverage == HalfCoverage.FIRST:  # V's per-forward fingerprint hashes no bytes
                halves[1:] = [[replace(s, read_bytes=0) for s in h] for h in halves[1:]]
            fp = Fingerprint(FingerprintSources(halves, spec.num_slots), cfg.fingerprint,
                             cfg.layer_stride_for(len(halves[0])), cfg.fingerprint_share)
        seal = None
        if cfg.sealing and spec.sources is not None:
            seal = Fingerprint(FingerprintSources([list(h) for h in spec.sources], spec.num_slots),
                               FingerprintMode.ALL)
        stripe = cfg.coverage == CoveragePolicy.WINDOW and spec.group == Group.FULL
        reuse = seal is not None and cfg.reuse_check

        def plan_buffers(on: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
            if not on:
                return None, None
            return _i64(cfg.req_capacity, NUM_PLAN_COLS, device=d), _i64(NUM_PLAN_STATUS_COLS, device=d)

        return GroupState(
            spec, head, tail, records, _i64(cfg.req_capacity, NUM_PLAN_COLS, device=d), status,
            *plan_buffers(stripe), fp, seal, *plan_buffers(reuse),
            write_workspaces=(write_workspace(cfg.token_capacity, d), write_workspace(cfg.token_capacity, d))
            if self.backend == "cuda" else (None, None),
            write_carries=write_carries(cfg.token_capacity, d) if self.backend == "cuda" and takes_carries(seal, fp)
            else None)

    def transfer_buffers(self) -> list[TransferBuffer]:
        """The canary records to send with the KV in a prefill->decode transfer, indexable by slot."""
        out: list[TransferBuffer] = []
        for g in self.groups:
            name = g.spec.group.name.lower()
            out.append((f"kvcanary.{name}.head", g.head.records))
            out.append((f"kvcanary.{name}.tail", g.tail.records))
        return out

    def device_bytes(self) -> int:
        """Bytes of device memory held by the canary (for capacity planning)."""
        seen: set[int] = set()
        total = 0
        for t in self._tensors():
            if t.device.type == self.device.type and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    def _tensors(self) -> list[torch.Tensor]:
        ts = [self.arena, self.truth_rows, self.batch_rows, self.batch_tokens, self.sweep_plan, self.sweep_status,
              self.plan_status]
        for g in self.groups:
            ts += [g.head.records, g.tail.records, g.plan, *(w for w in (*g.write_workspaces, g.write_carries)
                                                             if w is not None)]
        if self.token_pool is not None:
            ts += [self.token_pool.tokens, self.token_pool.lens]
        return ts
