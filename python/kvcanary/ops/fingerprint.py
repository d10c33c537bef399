"""Fingerprint op (docs/ops-contract.md 1): hash of a slot's real K/V bytes, torch reference + native wrapper."""

from __future__ import annotations

import torch
from kvcanary_schema import PARTIAL_READ_BYTES, FingerprintMode, FpSourceCol, Stage

from kvcanary import _native
from kvcanary.errors import CanaryInputError
from kvcanary.ops import hashes as H
from kvcanary.ops.types import Fingerprint, FingerprintSources, GroupView, check_backend, check_tensor


def fingerprint(sources: FingerprintSources, half: int, slots: torch.Tensor, positions: torch.Tensor,
                mode: FingerprintMode, layer_stride: int = 1, backend: str = "torch") -> torch.Tensor:
    """Fingerprint (int64, u64 bit-cast) of each group slot at its position for one half.

    Entries whose slot is outside ``[0, sources.num_slots)`` or whose position is outside ``[0, TOKEN_LIMIT)``
    get 0 (never read), as does every entry in mode NONE.
    """
    if not isinstance(sources, FingerprintSources):
        raise CanaryInputError(f"sources must be FingerprintSources, got {type(sources).__name__}")
    device = sources.device
    if isinstance(half, bool) or not isinstance(half, int) or not 0 <= half < len(sources.halves):
        raise CanaryInputError(f"half must be an int in [0, {len(sources.halves)}), got {half!r}")
    s = check_tensor(slots, "slots", ndim=1, device=device)
    p = check_tensor(positions, "positions", ndim=1, device=device, shape=(s.shape[0],))
    if not isinstance(mode, FingerprintMode):
        raise CanaryInputError(f"mode must be a FingerprintMode, got {mode!r}")
    if isinstance(layer_stride, bool) or not isinstance(layer_stride, int) or layer_stride < 1:
        raise CanaryInputError(f"layer_stride must be an int >= 1, got {layer_stride!r}")
    b = check_backend(backend, device)
    if b == "torch":
        return fingerprint_torch(sources, half, s, p, mode, layer_stride)
    out = torch.empty_like(s)
    _native.module(b).fingerprint(sources.table, half, s, p, int(mode), layer_stride, sources.num_slots, out)
    return out


def check_fingerprint(fp: Fingerprint | None, group: GroupView, stage: Stage, seal: bool = False) -> None:
    """Raise CanaryInputError unless ``fp`` (if given) may fingerprint ``group``'s records at ``stage``.

    HEAD verifies never fingerprint; a HEAD write may (``seal``: the seal is written after the forward).
    """
    if fp is None:
        return
    if not isinstance(fp, Fingerprint):
        raise CanaryInputError(f"fingerprint must be a Fingerprint, got {type(fp).__name__}")
    if stage == Stage.HEAD and not seal:
        raise CanaryInputError("fingerprint: HEAD verifies never fingerprint (HEAD records hold the seal, if any)")
    src = fp.sources
    if src.device != group.records.device:
        raise CanaryInputError(f"fingerprint sources on {src.device}, records on {group.records.device}")
    if len(src.halves) < group.halves:
        raise CanaryInputError(f"fingerprint sources have {len(src.halves)} halves, records {group.halves}")
    if src.num_slots < group.num_slots:
        raise CanaryInputError(f"fingerprint sources cover {src.num_slots} slots, the group has {group.num_slots}")


def fingerprint_torch(sources: FingerprintSources, half: int, slots: torch.Tensor, positions: torch.Tensor,
                      mode: FingerprintMode, layer_stride: int) -> torch.Tensor:
    """Vectorized reference of :func:`fingerprint` (no argument checks): one gather of words per source."""
    if mode == FingerprintMode.NONE or slots.numel() == 0:
        return torch.zeros_like(slots)
    dev = slots.device
    valid = (slots >= 0) & (slots < sources.num_slots) & H.chain_value_ok(positions)
    sc = torch.where(valid, slots, torch.zeros_like(slots))
    acc = torch.zeros_like(slots)
    meta = sources.table[half].tolist()
    for j, rows in enumerate(sources.rows[half]):
        page, bpt = meta[j][FpSourceCol.PAGE_SIZE], meta[j][FpSourceCol.BYTES_PER_TOKEN]
        rb = hashed_bytes(meta[j][FpSourceCol.READ_BYTES], mode)
        if rb == 0:  # a source that hashes nothing
            continue
        terms = H.fp_word_term(_slot_words(rows, page, bpt // 8, rb // 8, sc), j,
                               torch.arange(rb // 8, device=dev)).sum(1)
        selected = torch.remainder(positions + j, layer_stride) == 0
        acc = acc + torch.where(selected, terms, torch.zeros_like(terms))
    return torch.where(valid, H.fp_finalize(acc, positions), torch.zeros_like(slots))


def hashed_bytes(read_bytes: int, mode: FingerprintMode) -> int:
    """Bytes of a source row that ``mode`` hashes: its READ_BYTES, at most PARTIAL_READ_BYTES in PARTIAL mode (0: the
    source hashes nothing)."""
    return min(read_bytes, PARTIAL_READ_BYTES) if mode == FingerprintMode.PARTIAL else read_bytes


def _slot_words(rows: torch.Tensor, page: int, bpt_words: int, read_words: int, slots: torch.Tensor) -> torch.Tensor:
    """int64 ``[N, read_words]``: the first words of each slot's bytes, gathered as whole rows (no per-word index)."""
    # Base, row stride and bytes_per_token are FP_ALIGN_BYTES-aligned, so the byte rows view as int64 words.
    words = rows[:, : (rows.shape[1] // 8) * 8].view(torch.int64)
    num_rows, rs = words.shape[0], words.stride(0)
    if rs == page * bpt_words:  # pages are back to back: one row per slot
        per_slot = torch.as_strided(words, (num_rows * page, bpt_words), (bpt_words, 1))
        return per_slot.index_select(0, slots)[:, :read_words]
    span = (num_rows - 1) * rs + words.shape[1]
    windows = torch.as_strided(words, (span,), (1,)).unfold(0, read_words, 1)  # row k = words k .. k + read_words
    return windows.index_select(0, (slots // page) * rs + (slots % page) * bpt_words)
