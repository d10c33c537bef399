"""Batch staging (docs/ops-contract.md 8b): one forward's batch and token-truth rows into the static buffers the bound
ops read, padded to the bound shape, in one call; torch reference + native."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvcanary import _native
from kvcanary.errors import CanaryInputError
from kvcanary.ops.types import check_backend, check_tensor

_INDEX = (torch.int32, torch.int64)
SRC_NAMES = ("req_pool_indices", "prefix_lens", "extend_lens", "input_ids", "positions", "out_cache_loc")

# stage(req_pool_indices, prefix_lens, extend_lens, input_ids, positions, out_cache_loc, staging, rows, truth, tokens,
#       pad_rows, pad_tokens, padding_row)
Stager = Callable[..., None]


def stage_batch(src: Sequence[torch.Tensor], staging: torch.Tensor, rows: torch.Tensor, truth: torch.Tensor,
                tokens: torch.Tensor, pad_rows: int, pad_tokens: int, padding_row: int, backend: str = "torch") -> None:
    """``rows[:, :bs]`` = (req_pool_indices, prefix_lens, extend_lens), ``truth[:, :bs]`` = ``staging[:, :bs]``,
    ``tokens[:, :nt]`` = (input_ids, positions, out_cache_loc); rows ``[bs, pad_rows)`` become padding rows
    (``padding_row``, 0, 0) and tokens ``[nt, pad_tokens)`` get out_cache_loc -1.

    ``src``: the six batch arrays (int32/int64, 1-D, on the buffers' device; bs = len of the first, nt = len of the
    fourth); ``staging``: host int64 ``[U, >= bs]`` (pinned for the CUDA backend, whose kernel reads it in place);
    ``rows`` int64 ``[3, RC]``, ``truth`` int64 ``[U, RC]``, ``tokens`` int64 ``[3, TC]``.
    """
    b = check_backend(backend, rows.device)
    if b == "torch":
        _check(src, staging, rows, truth, tokens, pad_rows, pad_tokens)
        _stage_torch(src[0], src[1], src[2], src[3], src[4], src[5], staging, rows, truth, tokens, pad_rows,
                     pad_tokens, padding_row)
        return
    try:
        _native.module(b).stage_batch(*src, staging, rows, truth, tokens, pad_rows, pad_tokens, padding_row)
    except (TypeError, ValueError) as err:  # the native entry's checks, as this library's input error
        raise CanaryInputError(str(err)) from err


def stager(backend: str) -> Stager:
    """The per-forward entry of a checked backend: the native function itself (it checks every argument), or the torch
    reference (arguments checked by the caller)."""
    if backend == "torch":
        return _stage_torch
    fn: Stager = _native.module("cuda" if backend == "cuda" else "cpu").stage_batch
    return fn


def _check(src: Sequence[torch.Tensor], staging: torch.Tensor, rows: torch.Tensor, truth: torch.Tensor,
           tokens: torch.Tensor, pad_rows: int, pad_tokens: int) -> None:
    d = rows.device
    check_tensor(rows, "rows", ndim=2, device=d, shape=(3, None))
    check_tensor(truth, "truth", ndim=2, device=d, shape=(None, rows.shape[1]))
    check_tensor(tokens, "tokens", ndim=2, device=d, shape=(3, None))
    if len(src) != len(SRC_NAMES):
        raise CanaryInputError(f"stage_batch takes {len(SRC_NAMES)} batch arrays, got {len(src)}")
    bs, nt = (int(src[i].shape[0]) if isinstance(src[i], torch.Tensor) else 0 for i in (0, 3))
    for i, (name, t) in enumerate(zip(SRC_NAMES, src, strict=True)):
        check_tensor(t, name, dtype=_INDEX, ndim=1, device=d, shape=(bs if i < 3 else nt,))
    check_tensor(staging, "staging", ndim=2, device=torch.device("cpu"), shape=(truth.shape[0], None))
    if staging.shape[1] < bs:
        raise CanaryInputError(f"staging has {staging.shape[1]} columns, the batch has {bs} rows")
    if not bs <= pad_rows <= rows.shape[1]:
        raise CanaryInputError(f"pad_rows must lie in [{bs}, {rows.shape[1]}], got {pad_rows}")
    if not nt <= pad_tokens <= tokens.shape[1]:
        raise CanaryInputError(f"pad_tokens must lie in [{nt}, {tokens.shape[1]}], got {pad_tokens}")


def _stage_torch(req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
                 input_ids: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor, staging: torch.Tensor,
                 rows: torch.Tensor, truth: torch.Tensor, tokens: torch.Tensor, pad_rows: int, pad_tokens: int,
                 padding_row: int) -> None:
    bs, nt = req_pool_indices.shape[0], input_ids.shape[0]
    for r, t in enumerate((req_pool_indices, prefix_lens, extend_lens)):
        rows[r, :bs] = t
    for r, t in enumerate((input_ids, positions, out_cache_loc)):
        tokens[r, :nt] = t
    truth[:, :bs].copy_(staging[:, :bs], non_blocking=True)
    rows[0, bs:pad_rows] = padding_row
    rows[1:, bs:pad_rows] = 0
    tokens[2, nt:pad_tokens] = -1
