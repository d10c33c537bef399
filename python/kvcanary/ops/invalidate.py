"""Freed-slot invalidation (docs/ops-contract.md 11): the records of freed slots poisoned in every buffer; torch
reference + native."""

from __future__ import annotations

from collections.abc import Callable

import torch
from kvcanary_schema import MAX_HALVES, NO_SLOT, RECORD_NUM_FIELDS, RecordField

from kvcanary import _native
from kvcanary.errors import CanaryInputError
from kvcanary.ops.plan import check_scalar
from kvcanary.ops.types import check_backend, check_tensor

Invalidate = Callable[[torch.Tensor], None]  # takes the freed slot ids


def bind_invalidate(records: torch.Tensor, reserved: int = 0, backend: str = "torch") -> Invalidate:
    """``records`` and ``reserved`` checked once: a call that poisons the records of the freed slot ids it is given.

    ``records``: int64 [B, S, H, RECORD_NUM_FIELDS], B buffers (the canary's HEAD and TAIL in one tensor), H halves.
    The call takes int32/int64 [n] slot ids on the records' device or, for records on a CUDA device, in host memory
    (an engine's freed ids; the cuda backend carries them in its launches' parameters: no copy, no sync). Every id in
    ``[reserved, S)`` gets the poisoned record in every buffer and half: every field 0, the position NO_SLOT, so a
    later verify of the slot reports VERIFY_POSITION and the slot after it fails its chain check. Other ids (reserved
    slots, ids outside the pool) are left alone. Bad ids raise CanaryInputError before anything changes."""
    rec = check_tensor(records, "records", ndim=4)
    if rec.shape[0] < 1 or rec.shape[2] not in range(1, MAX_HALVES + 1) or rec.shape[3] != RECORD_NUM_FIELDS:
        raise CanaryInputError(f"records must be [B >= 1, S, 1|2, {RECORD_NUM_FIELDS}], got {tuple(rec.shape)}")
    r = check_scalar(reserved, "reserved", 0)
    if r > rec.shape[1]:
        raise CanaryInputError(f"reserved must be <= {rec.shape[1]} slots, got {r}")
    b = check_backend(backend, rec.device)
    fn = invalidate_torch if b == "torch" else _native.module(b).invalidate
    host_ok = rec.device.type == "cuda"

    def run(slots: torch.Tensor) -> None:
        s = check_tensor(slots, "slots", dtype=(torch.int32, torch.int64), ndim=1)
        if s.device != rec.device and not (host_ok and s.device.type == "cpu"):
            raise CanaryInputError(f"slots must be on {rec.device}{' or the host' if host_ok else ''}, got {s.device}")
        fn(rec, s, r)  # the records stay a torch tensor: tvm-ffi takes torch's current stream from them
    return run


def invalidate(records: torch.Tensor, slots: torch.Tensor, reserved: int = 0, backend: str = "torch") -> None:
    """:func:`bind_invalidate`'s call, once."""
    bind_invalidate(records, reserved, backend)(slots)


def invalidate_torch(records: torch.Tensor, slots: torch.Tensor, reserved: int) -> None:
    """Reference of the native op (no argument checks), with no host sync: the kept ids mark a slot mask whose extra
    last entry takes the ids left alone."""
    s = slots.to(device=records.device, dtype=torch.int64)
    num_slots = records.shape[1]
    idx = torch.where((s >= reserved) & (s < num_slots), s, num_slots)
    hit = torch.zeros(num_slots + 1, dtype=torch.bool, device=records.device).index_fill_(0, idx, True)[:num_slots]
    records.masked_fill_(hit.view(1, -1, 1, 1), 0)
    records.select(3, RecordField.POSITION).masked_fill_(hit.view(1, -1, 1), NO_SLOT)
