"""Expected-token pool append (docs/ops-contract.md 7): scatter new true tokens into pool rows, torch + native."""

from __future__ import annotations

import torch

from kvcanary import _native
from kvcanary.errors import CanaryInputError
from kvcanary.ops.types import TokenPool, check_backend, check_tensor


def scatter_tokens(pool: TokenPool, rows: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor,
                   tokens: torch.Tensor, status: torch.Tensor, backend: str = "torch") -> None:
    """Per request i: ``pool.tokens[rows[i], starts[i]:starts[i]+counts[i]]`` = its slice of the flat ``tokens``.

    Request i's slice starts at the sum of ``clamp(counts[k], 0, len(tokens) + 1)`` over k < i; ``pool.lens[row]``
    becomes ``start + count``. Invalid requests (row out of range, start < 0, count < 0, past the pool row or
    past ``tokens``) are skipped and counted into ``status[0]`` (int64 ``[1]``, accumulated).
    """
    if not isinstance(pool, TokenPool):
        raise CanaryInputError(f"pool must be a TokenPool, got {type(pool).__name__}")
    device = pool.tokens.device
    r = check_tensor(rows, "rows", ndim=1, device=device)
    n = r.shape[0]
    st = check_tensor(starts, "starts", ndim=1, device=device, shape=(n,))
    c = check_tensor(counts, "counts", ndim=1, device=device, shape=(n,))
    tok = check_tensor(tokens, "tokens", ndim=1, device=device)
    s = check_tensor(status, "status", ndim=1, device=device, shape=(1,))
    b = check_backend(backend, device)
    if b == "torch":
        _scatter_torch(pool, r, st, c, tok, s)
        return
    _native.module(b).scatter_tokens(pool.tokens, pool.lens, r, st, c, tok, s)


def _scatter_torch(pool: TokenPool, rows: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor,
                   tokens: torch.Tensor, status: torch.Tensor) -> None:
    num_rows, width = pool.tokens.shape
    total = tokens.shape[0]
    adv = torch.clamp(counts, 0, total + 1)
    off = torch.cumsum(adv, 0) - adv
    ok = ((rows >= 0) & (rows < num_rows) & (starts >= 0) & (counts >= 0) & (starts <= width)
          & (counts <= width - starts) & (off <= total) & (counts <= total - off))
    status[0] += (~ok).sum()
    r, st, c, o = rows[ok], starts[ok], counts[ok], off[ok]
    rid = torch.repeat_interleave(torch.arange(r.shape[0], device=rows.device), c)
    within = torch.arange(rid.shape[0], device=rows.device) - (torch.cumsum(c, 0) - c)[rid]
    pool.tokens[r[rid], st[rid] + within] = tokens[o[rid] + within]
    pool.lens[r] = st + c
