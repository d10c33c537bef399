"""The engine adapter: pool description, per-forward batch view, prefix-cache export and transfer buffers."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import numpy as np
import torch
from kvcanary_schema import Group

from kvcanary.errors import CanaryInputError
from kvcanary.ops.types import SourceSpec, check_tensor, check_tensors

_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class GroupSpec:
    """One pool group: its slots, halves, reserved slots, SWA map/window and real-KV sources per half.

    ``sources[h]`` lists the layer tensors of half ``h`` (K then V) whose bytes the fingerprint hashes;
    ``None`` when the engine exposes no real KV (fingerprint mode must then be NONE).
    """

    group: Group
    num_slots: int
    halves: int = 2
    reserved_slots: int = 0
    swa_map: torch.Tensor | None = None  # int64 [table slots]: table slot -> group slot, NO_SLOT = evicted
    window: int = 0  # SWA window (verified positions per request); 0 for FULL
    sources: Sequence[Sequence[SourceSpec]] | None = None

    def validate(self, device: torch.device, table_slots: int) -> None:
        """Raise CanaryInputError unless the group is self-consistent and on ``device``."""
        name = f"group {self.group.name}"
        if self.num_slots < 1:
            raise CanaryInputError(f"{name}: num_slots must be >= 1, got {self.num_slots}")
        if self.halves not in (1, 2):
            raise CanaryInputError(f"{name}: halves must be 1 (K only) or 2 (K and V), got {self.halves}")
        if not 0 <= self.reserved_slots <= self.num_slots:
            raise CanaryInputError(f"{name}: reserved_slots must be in [0, {self.num_slots}], "
                                   f"got {self.reserved_slots}")
        if self.group == Group.SWA:
            if self.swa_map is None:
                raise CanaryInputError(f"{name}: an SWA group needs swa_map (table slot -> SWA slot)")
            check_tensor(self.swa_map, f"{name}: swa_map", ndim=1, device=device)
            if self.swa_map.shape[0] < table_slots:
                raise CanaryInputError(f"{name}: swa_map has {self.swa_map.shape[0]} entries, table space has "
                                       f"{table_slots} slots")
            if self.window < 1:
                raise CanaryInputError(f"{name}: an SWA group needs window >= 1, got {self.window}")
        else:
            if self.swa_map is not None:
                raise CanaryInputError(f"{name}: swa_map is only for SWA groups")
            if self.window != 0:
                raise CanaryInputError(f"{name}: window is only for SWA groups, got {self.window}")
            if self.num_slots != table_slots:
                raise CanaryInputError(f"{name}: a FULL group has the table's {table_slots} slots, "
                                       f"got {self.num_slots}")
        if self.sources is not None:
            if len(self.sources) != self.halves:
                raise CanaryInputError(f"{name}: sources must list {self.halves} halves, got {len(self.sources)}")
            for h, specs in enumerate(self.sources):
                if not specs:
                    raise CanaryInputError(f"{name}: sources[{h}] is empty")
                for j, spec in enumerate(specs):
                    if not isinstance(spec, SourceSpec):
                        raise CanaryInputError(f"{name}: sources[{h}][{j}] must be a SourceSpec")
                    if spec.tensor.device != device:
                        raise CanaryInputError(f"{name}: sources[{h}][{j}] is on {spec.tensor.device}, "
                                               f"pool on {device}")


@dataclass(frozen=True)
class PoolDescription:
    """What kvcanary needs to know about the engine's KV pool (DESIGN 7)."""

    num_slots: int  # table-space slots (the FULL pool)
    req_rows: int  # rows of req_to_token
    max_context: int  # columns of req_to_token
    groups: Sequence[GroupSpec]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    page_size: int = 1
    padding_row: int = -1  # req_to_token row of padded batch entries; -1 = none
    token_offset: int = 0  # draft (EAGLE-style) pools: slot at position p holds KV of the token at p + 1
    # slots per slot-table entry: 1 = req_to_token [req_rows, max_context] of slots; P > 1 = a block table
    # [req_rows, ceil(max_context / P)] of block ids, slot = table[r, c // P] * P + c % P (vLLM's block tables)
    table_page: int = 1

    @cached_property  # read by every forward's slot-table check
    def table_cols(self) -> int:
        """Entries per row of the slot table the batches carry."""
        return -(-self.max_context // self.table_page)

    @property
    def resolved_device(self) -> torch.device:
        """The device with its index (``cuda`` resolves to the current CUDA device)."""
        d = torch.device(self.device)
        if d.type == "cuda" and d.index is None:
            d = torch.device("cuda", torch.cuda.current_device())
        return d

    def validate(self) -> None:
        """Raise CanaryInputError naming the first inconsistent field."""
        for knob in ("num_slots", "req_rows", "max_context", "page_size", "table_page"):
            if getattr(self, knob) < 1:
                raise CanaryInputError(f"PoolDescription.{knob} must be >= 1, got {getattr(self, knob)}")
        if not -1 <= self.padding_row < self.req_rows:
            raise CanaryInputError(f"PoolDescription.padding_row must be -1 or a row < {self.req_rows}, "
                                   f"got {self.padding_row}")
        if self.token_offset < 0:
            raise CanaryInputError(f"PoolDescription.token_offset must be >= 0, got {self.token_offset}")
        if not self.groups:
            raise CanaryInputError("PoolDescription.groups is empty")
        kinds = [g.group for g in self.groups]
        if len(set(kinds)) != len(kinds):
            raise CanaryInputError(f"PoolDescription.groups: at most one group per kind, got {[k.name for k in kinds]}")
        for g in self.groups:
            g.validate(self.resolved_device, self.num_slots)


@dataclass(frozen=True)
class BatchView:
    """One forward as the engine runs it (rows include padding; the graph consumes exactly these tensors).

    ``true_tokens[i]`` is request i's true token history (prompt + committed outputs; never unverified draft
    tokens) — the token truth. The ``*_host`` sequences mirror the device tensors so that nothing syncs.
    """

    req_pool_indices: torch.Tensor  # int32/int64 [bs]
    prefix_lens: torch.Tensor  # [bs]
    extend_lens: torch.Tensor  # [bs]
    req_to_token: torch.Tensor  # int32/int64 [R, L] (a block table [R, ceil(L / P)] when the pool's table_page P > 1)
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    out_cache_loc: torch.Tensor  # [num_tokens], table-space slots, negative = skipped
    request_ids: Sequence[Hashable | None]  # None for padding rows
    req_pool_indices_host: Sequence[int] | np.ndarray
    prefix_lens_host: Sequence[int] | np.ndarray
    extend_lens_host: Sequence[int] | np.ndarray
    true_tokens: Sequence[Sequence[int]] | None = None
    token_offset: int | None = None  # None: the pool's
    # token truth computed by the engine (e.g. vLLM's scheduler, kvcanary.truth.chain_truth): per row
    # (expect_prefix, expect_new) as int64 chain values, None where unknown; used instead of true_tokens
    expected_chains: Sequence[tuple[int | None, int | None]] | None = None
    # the fast form of token truth (no Python step per request): host int64 [num_tokens], flat like input_ids, the
    # true token of each new position p (true_tokens[i][p + offset]), negative where unknown. Requests that continue
    # where their previous forward left off are hashed from it in bulk; the others (new, moved, rewound) still catch
    # up from ``true_tokens``. The *_host facts may be int64 numpy arrays as well as lists (no conversion then).
    true_new_tokens: torch.Tensor | np.ndarray | None = None

    @property
    def batch_size(self) -> int:
        """Rows, padding included."""
        return len(self.req_pool_indices_host)

    @property
    def num_tokens(self) -> int:
        """New tokens of the forward (a shape, no sync)."""
        return int(self.input_ids.shape[0])

    def validate(self, pool: PoolDescription, req_capacity: int, token_capacity: int,
                 device: torch.device | None = None) -> None:
        """Raise CanaryInputError for a batch that does not fit the pool or the installed capacities (``device``: the
        pool's resolved device, when the caller holds it)."""
        device = pool.resolved_device if device is None else device
        self.validate_fit(pool, req_capacity, token_capacity, device)
        self.validate_arrays(device)

    def validate_fit(self, pool: PoolDescription, req_capacity: int, token_capacity: int,
                     device: torch.device, checked_table: torch.Tensor | None = None) -> None:
        """The part of :meth:`validate` that no native op checks: sizes against the capacities, the slot table, the
        host facts' lengths. ``checked_table``: a slot table that passed before; when it is this batch's, only its
        shape and layout are checked again (its dtype and device cannot change)."""
        bs = self.batch_size
        if bs > req_capacity:
            raise CanaryInputError(f"batch has {bs} requests, the canary was installed for req_capacity={req_capacity}")
        if not isinstance(self.input_ids, torch.Tensor):  # it defines num_tokens: check it is a tensor first
            check_tensor(self.input_ids, "batch.input_ids", dtype=_INDEX_DTYPES, ndim=1, device=device)
        n = self.num_tokens
        if n > token_capacity:
            raise CanaryInputError(f"batch has {n} tokens, the canary was installed for "
                                   f"token_capacity={token_capacity}")
        self.check_table(pool, device, checked_table)
        for name, given in (("request_ids", self.request_ids), ("prefix_lens_host", self.prefix_lens_host),
                            ("extend_lens_host", self.extend_lens_host)):
            if len(given) != bs:
                raise CanaryInputError(f"batch.{name} has {len(given)} entries, batch size is {bs}")
        for name, value in (("true_tokens", self.true_tokens), ("expected_chains", self.expected_chains)):
            if value is not None and len(value) != bs:
                raise CanaryInputError(f"batch.{name} has {len(value)} entries, batch size is {bs}")
        new = self.true_new_tokens
        if new is not None and (new.shape[0] if isinstance(new, torch.Tensor) else len(new)) != n:
            raise CanaryInputError(f"batch.true_new_tokens has {len(new)} entries, the batch has {n} new tokens")
        if self.token_offset is not None and self.token_offset < 0:
            raise CanaryInputError(f"batch.token_offset must be >= 0, got {self.token_offset}")

    def check_table(self, pool: PoolDescription, device: torch.device,
                    checked_table: torch.Tensor | None = None) -> None:
        """The slot table's fit (part of :meth:`validate_fit`): dtype and device, unless it is ``checked_table`` (which
        passed before: its dtype and device cannot change), then layout and shape."""
        table = self.req_to_token
        if table is not checked_table or not table.is_contiguous():
            check_tensor(table, "batch.req_to_token", dtype=_INDEX_DTYPES, ndim=2, device=device)
        if table.shape[1] != pool.table_cols or table.shape[0] > pool.req_rows:
            raise CanaryInputError(f"batch.req_to_token has shape {tuple(table.shape)}, the pool's slot table is "
                                   f"[<= {pool.req_rows}, {pool.table_cols}]")

    def validate_arrays(self, device: torch.device) -> None:
        """The part of :meth:`validate` that the native ``begin_decode`` also checks (docs/ops-contract.md 8c): the six
        batch tensors and the extend lengths' sum."""
        bs, n = self.batch_size, self.num_tokens
        check_tensors((("batch.req_pool_indices", self.req_pool_indices), ("batch.prefix_lens", self.prefix_lens),
                       ("batch.extend_lens", self.extend_lens)), dtype=_INDEX_DTYPES, shape=(bs,), device=device)
        check_tensors((("batch.input_ids", self.input_ids), ("batch.positions", self.positions),
                       ("batch.out_cache_loc", self.out_cache_loc)), dtype=_INDEX_DTYPES, shape=(n,), device=device)
        if not extends_fit(np.asarray(self.extend_lens_host, dtype=np.int64), n):
            raise CanaryInputError(f"batch.extend_lens_host sums to more than the {n} new tokens")


def extends_fit(ext: np.ndarray, n: int) -> bool:
    """Whether the extend lengths ``ext`` (int64) claim at most ``n`` new tokens in all (negative ones count 0)."""
    # each at most n first: then the int64 sum of a batch's lengths cannot wrap
    return not ext.size or (int(ext.max()) <= n and int(np.maximum(ext, 0).sum()) <= n)


@dataclass(frozen=True)
class PrefixCacheExport:
    """The cached chains of the prefix cache, flattened (vectorized export for the sweep; table-space slots).

    Chain c covers ``slots[starts[c] : starts[c] + lens[c]]`` at positions ``first_positions[c] + i``;
    ``prev_slots[c]`` is the slot before its first (NO_SLOT = chain head); ``unlocked[c]`` is True when no
    running request holds it; ``expect_end[c]`` (optional) is the true chain value after its last token;
    ``holders[c]`` (optional, host) names the requests that last held the chain, for sweep reports.
    An export is immutable once returned: an adapter whose cache has not changed may return the same object again,
    and the rolling sweep then reuses what it derived from it; a changed cache needs a new object.
    """

    slots: torch.Tensor  # int64 [N]
    starts: torch.Tensor  # int64 [n]
    lens: torch.Tensor  # int64 [n]
    first_positions: torch.Tensor  # int64 [n]
    prev_slots: torch.Tensor  # int64 [n]
    unlocked: torch.Tensor | None = None  # bool [n]
    expect_end: torch.Tensor | None = None  # int64 [n]
    holders: Sequence[tuple[Hashable, ...]] | None = None  # [n], host

    @property
    def num_chains(self) -> int:
        """Chains in the export."""
        return int(self.starts.shape[0])

    def validate(self, device: torch.device) -> None:
        """Raise CanaryInputError unless every tensor is a contiguous 1-D tensor of its contract dtype."""
        check_tensor(self.slots, "export.slots", ndim=1, device=device)
        n = self.num_chains
        for name in ("starts", "lens", "first_positions", "prev_slots"):
            check_tensor(getattr(self, name), f"export.{name}", ndim=1, device=device, shape=(n,))
        if self.unlocked is not None:
            check_tensor(self.unlocked, "export.unlocked", dtype=torch.bool, ndim=1, device=device, shape=(n,))
        if self.expect_end is not None:
            check_tensor(self.expect_end, "export.expect_end", ndim=1, device=device, shape=(n,))
        if self.holders is not None and len(self.holders) != n:
            raise CanaryInputError(f"export.holders has {len(self.holders)} entries for {n} chains")


TransferBuffer = tuple[str, torch.Tensor]  # (name, tensor whose dim 0 indexes table-space/group slots)


def check_transfer_buffers(buffers: Sequence[TransferBuffer]) -> None:
    """Raise CanaryInputError unless the buffers have unique names and a leading slot dimension."""
    names = [name for name, _ in buffers]
    if len(set(names)) != len(names):
        raise CanaryInputError(f"transfer buffers need unique names, got {names}")
    for name, t in buffers:
        if not isinstance(t, torch.Tensor) or t.dim() < 1:
            raise CanaryInputError(f"transfer buffer {name!r} must be a tensor [num_slots, ...]")


def copy_transfer(src: Sequence[TransferBuffer], src_slots: torch.Tensor, dst: Sequence[TransferBuffer],
                  dst_slots: torch.Tensor) -> None:
    """Copy the rows ``src_slots`` of every source buffer to rows ``dst_slots`` of the same-named buffer
    (an in-process stand-in for a prefill->decode transfer that relocates slots)."""
    check_transfer_buffers(src)
    check_transfer_buffers(dst)
    by_name = dict(dst)
    if set(by_name) != {name for name, _ in src}:
        raise CanaryInputError("source and destination transfer buffers differ in names")
    check_tensor(src_slots, "src_slots", ndim=1)
    check_tensor(dst_slots, "dst_slots", ndim=1, shape=(src_slots.shape[0],))
    for name, t in src:
        d = by_name[name]
        if d.shape[1:] != t.shape[1:] or d.dtype != t.dtype:
            raise CanaryInputError(f"transfer buffer {name!r}: row shapes/dtypes differ")
        d.index_copy_(0, dst_slots.to(d.device), t.index_select(0, src_slots.to(t.device)).to(d.device))


class EngineAdapter(Protocol):
    """What an engine implements so that kvcanary can guard its pool (kvcanary never imports an engine)."""

    def pool_description(self) -> PoolDescription:
        """The pool (called once, at install)."""
        ...

    def prefix_cache_export(self) -> PrefixCacheExport | None:
        """The cached chains for a sweep (None: no prefix cache)."""
        ...
