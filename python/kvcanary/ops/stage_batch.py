"""Batch staging (docs/ops-contract.md 8b): one forward's batch and token-truth rows into the static buffers the bound
ops read, padded to the bound shape, in one call; and a steady batch's token truth with its staging in one call
(``begin_decode``, 8c). Torch references + native."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import numpy as np
import torch
import tvm_ffi
from kvcanary_schema import TOKEN_LIMIT, PlanFlag

from kvcanary import _native
from kvcanary.errors import CanaryInputError
from kvcanary.ops import hashes as H
from kvcanary.ops.types import check_backend, check_tensor

_INDEX = (torch.int32, torch.int64)
STAGING_ROWS = 5  # the token-truth staging rows (docs/ops-contract.md 8a): expect_prefix, expect_new, mask, two ends
SRC_NAMES = ("req_pool_indices", "prefix_lens", "extend_lens", "input_ids", "positions", "out_cache_loc")

# stage(req_pool_indices, prefix_lens, extend_lens, input_ids, positions, out_cache_loc, staging, rows, truth, tokens,
#       pad_rows, pad_tokens, padding_row)
Stager = Callable[..., None]
# begin_decode(the stage arguments, host_rows, host_pre, host_ext, true_new, live, h, n, offset, seen, prefix, step,
#   reuse, event) -> int
Decoder = Callable[..., int]
NOT_STEADY, BAD_VALUE = -1, -2  # begin_decode's results that stage nothing
NO_REUSE = np.zeros(0, dtype=np.int64)  # begin_decode's reuse ends when there are none (every row's is 0)


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
        self._decode: Decoder = _begin_decode_checked
        args: list[object] = [*staging, rows, truth, tokens]
        if self.backend != "torch":
            mod = _native.module("cuda" if self.backend == "cuda" else "cpu")
            self._fn, self._decode = mod.stage_batch, mod.begin_decode
            args = [tvm_ffi.from_dlpack(t) for t in args]
        self._staging, self._dst, self.padding_row = args[:len(staging)], tuple(args[len(staging):]), padding_row
        # no reuse ends (a steady decode's): converted once, as the static arguments
        self._no_reuse = NO_REUSE if self.backend == "torch" else tvm_ffi.from_dlpack(NO_REUSE)

    def __call__(self, src: Sequence[torch.Tensor], k: int, pad_rows: int, pad_tokens: int) -> None:
        """Stage ``src`` (the six batch arrays, checked by the caller: ``BatchView.validate``) with staging buffer
        ``k``."""
        self._fn(*src, self._staging[k], *self._dst, pad_rows, pad_tokens, self.padding_row)

    def host(self, values: np.ndarray) -> object:
        """A host array as :meth:`decode` takes it, converted once for the native op (the array stays shared)."""
        return values if self.backend == "torch" else tvm_ffi.from_dlpack(values)

    def row_state(self, h: np.ndarray, n: np.ndarray, seen: np.ndarray, prefix: np.ndarray) -> tuple[object, ...]:
        """The per-row state :meth:`decode` updates, converted once for the native op (the arrays stay shared)."""
        arrays = (h.view(np.int64), n, seen, prefix)
        return tuple(self.host(a) for a in arrays)

    def decode(self, src: Sequence[torch.Tensor], k: int, pad_rows: int, pad_tokens: int, host: Sequence[object],
               true_new: np.ndarray | torch.Tensor, live: object, rows: tuple[object, ...], offset: int,
               step: int, reuse: np.ndarray | None = None, event: int = 0) -> int:
        """:func:`begin_decode` with staging buffer ``k`` (``host``: the batch's rows, prefix and extend lengths, and
        ``live``, as numpy arrays or :meth:`host`'s forms; ``rows``: :meth:`row_state`; ``reuse``: the reuse ends,
        None: none; ``event``: the buffer's CUDA event)."""
        h, n, seen, prefix = rows
        return self._decode(*src, self._staging[k], *self._dst, pad_rows, pad_tokens, self.padding_row, *host, true_new,
                            live, h, n, offset, seen, prefix, step, self._no_reuse if reuse is None else reuse, event)


def begin_decode(src: Sequence[torch.Tensor], staging: torch.Tensor, rows: torch.Tensor, truth: torch.Tensor,
                 tokens: torch.Tensor, pad_rows: int, pad_tokens: int, padding_row: int, host: Sequence[np.ndarray],
                 true_new: np.ndarray, live: np.ndarray, h: np.ndarray, n: np.ndarray, offset: int,
                 seen: np.ndarray, prefix: np.ndarray, step: int, backend: str = "torch",
                 reuse: np.ndarray | None = None, event: int = 0) -> int:
    """A steady batch's token truth and staging in one call (docs/ops-contract.md 8c): :func:`stage_batch`'s arguments,
    then ``host`` = (rows, prefix lengths, extend lengths) int64 [bs], ``true_new`` int64 [nt] (negative = unknown),
    ``live`` bool [bs], the rows' chain state ``h`` (u64 as int64) / ``n`` and their ``seen`` / ``prefix``, int64 [R],
    and ``reuse``, int64 [bs], the reuse ends (None: 0). When every live row continues its chain with its new tokens,
    the staging rows ``staging[:5, :bs]`` get the expected chains, flag mask and reuse ends (8a), the rows advance, each
    live row's ``seen`` becomes ``step`` and its ``prefix`` its prefix length, the batch is staged (8b) and the count of
    live rows whose new tokens are not all known returned; else NOT_STEADY or BAD_VALUE with nothing written. Input
    errors (8b's, ``host``, ``live`` or ``reuse`` not of the batch's length, ``ext`` claiming more than nt tokens, row
    state arrays of different lengths, a non-zero ``event`` off the CUDA backend) raise CanaryInputError before
    anything is written. ``event``: CUDA backend, a live ``cudaEvent_t`` of the buffers' device as an int (0: none)
    guarding the pinned staging rows: awaited before they are written, recorded after the launch that reads them."""
    b = check_backend(backend, rows.device)
    args = (*src, staging, rows, truth, tokens, pad_rows, pad_tokens, padding_row, *host, true_new, live, h, n, offset,
            seen, prefix, step, NO_REUSE if reuse is None else reuse, event)
    if b == "torch":
        return _begin_decode_checked(*args)
    try:
        return int(_native.module(b).begin_decode(*args))
    except (TypeError, ValueError) as err:
        raise CanaryInputError(str(err)) from err


def _begin_decode_checked(*args: object) -> int:
    """The torch reference after stage_batch's checks (the native op checks the same)."""
    staging, rows, truth, tokens = cast(tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], args[6:10])
    _check(cast(Sequence[torch.Tensor], args[:6]), staging, rows, truth, tokens, cast(int, args[10]),
           cast(int, args[11]))
    return cast(Decoder, _begin_decode_torch)(*args)


def _begin_decode_torch(req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
                        input_ids: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor,
                        staging: torch.Tensor, rows: torch.Tensor, truth: torch.Tensor, tokens: torch.Tensor,
                        pad_rows: int, pad_tokens: int, padding_row: int, host_rows: np.ndarray, host_pre: np.ndarray,
                        host_ext: np.ndarray, true_new: np.ndarray | torch.Tensor, live: np.ndarray, h: np.ndarray,
                        n: np.ndarray, offset: int, seen: np.ndarray, prefix: np.ndarray, step: int,
                        reuse: np.ndarray, event: int) -> int:
    """The reference: one Python step per row and token (Python ints for the chain, the oracle of the C++ loop);
    ``event`` must be 0 (the CPU op's rule: an event guards the CUDA op's pinned staging)."""
    if event != 0:
        raise CanaryInputError("begin_decode: event must be 0 off the CUDA backend")
    bs, nt = int(req_pool_indices.shape[0]), int(input_ids.shape[0])
    tok = true_new.tolist() if isinstance(true_new, torch.Tensor) else np.asarray(true_new).tolist()
    r, p, e, lv = (np.asarray(v).tolist() for v in (host_rows, host_pre, host_ext, live))
    ends = np.asarray(reuse).tolist() or [0] * bs
    if not len(r) == len(p) == len(e) == len(lv) == len(ends) == bs or len(tok) != nt or \
            staging.shape[0] != STAGING_ROWS or not seen.shape == prefix.shape == n.shape == h.shape:
        raise CanaryInputError(f"begin_decode: host facts of {bs} rows and {nt} tokens, {STAGING_ROWS} staging rows "
                               "expected")
    if sum(max(x, 0) for x in e) > nt:
        raise CanaryInputError(f"begin_decode: ext sums to more than the {nt} new tokens")
    starts = np.cumsum([0, *e[:-1]]).tolist() if bs else []
    for i in range(bs):
        if e[i] < 0:
            return NOT_STEADY
        if not lv[i]:
            continue
        if not 0 <= r[i] < h.shape[0] or starts[i] + e[i] > len(tok) or int(n[r[i]]) != p[i] + offset:
            return NOT_STEADY
        mine = tok[starts[i]:starts[i] + e[i]]
        if any(not 0 <= p[i] + j < TOKEN_LIMIT or t >= TOKEN_LIMIT for j, t in enumerate(mine)):
            return BAD_VALUE
    out = staging.numpy()
    hu = h.view(np.uint64)
    before = hu.copy()
    unknown = 0
    for i in range(bs):
        ep = en = 0
        mask = -1
        if lv[i]:
            h0, mine = int(before[r[i]]), tok[starts[i]:starts[i] + e[i]]
            ep = H.to_i64(h0) if p[i] > 0 else 0
            if mine and min(mine) >= 0:
                for j, t in enumerate(mine):
                    h0 = H.chain_step_int(h0, t, p[i] + j)
                en = H.to_i64(h0)
                hu[r[i]], n[r[i]] = h0, p[i] + e[i] + offset
            else:
                mask, unknown = ~int(PlanFlag.EXPECT_NEW), unknown + 1
            seen[r[i]], prefix[r[i]] = step, p[i]
        out[:, i] = (ep, en, mask, 0, ends[i])
    _stage_torch(req_pool_indices, prefix_lens, extend_lens, input_ids, positions, out_cache_loc, staging, rows, truth,
                 tokens, pad_rows, pad_tokens, padding_row)
    return unknown


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
