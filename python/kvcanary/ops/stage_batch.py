"""Batch staging (docs/ops-contract.md 8b): one forward's batch and token-truth rows into the static buffers the bound
ops read, padded to the bound shape, in one call; torch reference + native."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import tvm_ffi

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


class BatchStager:
    """stage_batch with the static arguments bound once: the staging buffers (one per double-buffered row set), the
    destinations and the padding row, checked here (the native entry checks them again on every call), and for a
    native backend pre-converted to tvm-ffi tensors (no per-call DLPack exchange for them; the batch tensors stay torch
    tensors, so tvm-ffi still takes torch's current stream from them)."""

    def __init__(self, staging: Sequence[torch.Tensor], rows: torch.Tensor, truth: torch.Tensor, tokens: torch.Tensor,
                 padding_row: int, backend: str) -> None:
        self.backend = check_backend(backend, rows.device)
        for t in staging:
            _check_static(t, rows, truth, tokens)
        self._fn: Stager = _stage_torch
        args: list[object] = [*staging, rows, truth, tokens]
        if self.backend != "torch":
            self._fn = _native.module("cuda" if self.backend == "cuda" else "cpu").stage_batch
            args = [tvm_ffi.from_dlpack(t) for t in args]
        self._staging, self._dst, self.padding_row = args[:len(staging)], tuple(args[len(staging):]), padding_row

    def __call__(self, src: Sequence[torch.Tensor], k: int, pad_rows: int, pad_tokens: int) -> None:
        """Stage ``src`` (the six batch arrays, checked by the caller: ``BatchView.validate``) with staging buffer
        ``k``."""
        self._fn(*src, self._staging[k], *self._dst, pad_rows, pad_tokens, self.padding_row)


def _check_static(staging: torch.Tensor, rows: torch.Tensor, truth: torch.Tensor, tokens: torch.Tensor) -> None:
    """The arguments that do not change between forwards: shapes, dtypes, devices (the batch's fit is _check's)."""
    d = rows.device
    check_tensor(rows, "rows", ndim=2, device=d, shape=(3, None))
    check_tensor(truth, "truth", ndim=2, device=d, shape=(None, rows.shape[1]))
    check_tensor(tokens, "tokens", ndim=2, device=d, shape=(3, None))
    check_tensor(staging, "staging", ndim=2, device=torch.device("cpu"), shape=(truth.shape[0], None))


def _check(src: Sequence[torch.Tensor], staging: torch.Tensor, rows: torch.Tensor, truth: torch.Tensor,
           tokens: torch.Tensor, pad_rows: int, pad_tokens: int) -> None:
    _check_static(staging, rows, truth, tokens)
    d = rows.device
    if len(src) != len(SRC_NAMES):
        raise CanaryInputError(f"stage_batch takes {len(SRC_NAMES)} batch arrays, got {len(src)}")
    bs, nt = (int(src[i].shape[0]) if isinstance(src[i], torch.Tensor) else 0 for i in (0, 3))
    for i, (name, t) in enumerate(zip(SRC_NAMES, src, strict=True)):
        check_tensor(t, name, dtype=_INDEX, ndim=1, device=d, shape=(bs if i < 3 else nt,))
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
