"""Chain and fingerprint hashes (DESIGN 4): torch reference on int64 tensors, Python ints, native wrappers."""

from __future__ import annotations

import torch
from kvcanary_schema import (
    CHAIN_ANCHOR,
    CHAIN_BASE,
    CHAIN_SEED,
    FP_GAMMA,
    FP_POS_SEED,
    FP_SEED,
    SPLITMIX_MUL1,
    SPLITMIX_MUL2,
    TOKEN_LIMIT,
)

from kvcanary.errors import CanaryInputError

U64 = (1 << 64) - 1


def to_i64(v: int) -> int:
    """Reinterpret a u64 Python int as the int64 stored in tensors."""
    v &= U64
    return v - (1 << 64) if v >= 1 << 63 else v


def to_u64(v: int) -> int:
    """Reinterpret a stored int64 as u64."""
    return v & U64


# ---- Python ints (the host hasher and independent test vectors) -------------------------------------------

def splitmix64_int(x: int) -> int:
    """splitmix64 finalizer on a Python int (u64 in, u64 out)."""
    x &= U64
    x ^= x >> 30
    x = (x * SPLITMIX_MUL1) & U64
    x ^= x >> 27
    x = (x * SPLITMIX_MUL2) & U64
    return x ^ (x >> 31)


def chain_g_int(token: int, position: int) -> int:
    """g(t, p) for 0 <= t, p < TOKEN_LIMIT."""
    if not (0 <= token < TOKEN_LIMIT and 0 <= position < TOKEN_LIMIT):
        raise CanaryInputError(f"token {token} / position {position} outside [0, {TOKEN_LIMIT})")
    return splitmix64_int(((position << 32) | token) ^ CHAIN_SEED)


CHAIN_H0 = splitmix64_int(CHAIN_ANCHOR)


def chain_step_int(h: int, token: int, position: int) -> int:
    """h_{k+1} = h_k * CHAIN_BASE + g(t_k, p_k) mod 2^64."""
    return (h * CHAIN_BASE + chain_g_int(token, position)) & U64


# ---- torch (int64 tensors, u64 semantics) -------------------------------------------------------------------
# torch has no uint64 arithmetic on every device; int64 multiply/add wrap mod 2^64 identically, and a logical
# right shift is an arithmetic shift with the sign-extended high bits masked off.

def _c(v: int) -> int:
    return to_i64(v)


def _lsr(x: torch.Tensor, k: int) -> torch.Tensor:
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finalizer, elementwise on an int64 tensor."""
    x = x ^ _lsr(x, 30)
    x = x * _c(SPLITMIX_MUL1)
    x = x ^ _lsr(x, 27)
    x = x * _c(SPLITMIX_MUL2)
    return x ^ _lsr(x, 31)


def chain_value_ok(v: torch.Tensor) -> torch.Tensor:
    """Mask of tokens/positions that may enter the chain."""
    return (v >= 0) & (v < TOKEN_LIMIT)


def chain_g(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """g(t, p) elementwise (callers mask out-of-range inputs with chain_value_ok)."""
    return splitmix64(((positions << 32) | tokens) ^ _c(CHAIN_SEED))


def chain_step(h: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """h * CHAIN_BASE + g(t, p) elementwise."""
    return h * _c(CHAIN_BASE) + chain_g(tokens, positions)


def chain_h0() -> int:
    """h_0 as the stored int64."""
    return to_i64(CHAIN_H0)


def fp_word_term(words: torch.Tensor, source: torch.Tensor | int, word_index: torch.Tensor) -> torch.Tensor:
    """splitmix64(word ^ (FP_SEED + ((source << 32) + i) * FP_GAMMA)), elementwise."""
    key = ((torch.as_tensor(source, dtype=torch.int64, device=words.device) << 32) + word_index) * _c(FP_GAMMA)
    return splitmix64(words ^ (key + _c(FP_SEED)))


def fp_finalize(acc: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Final fingerprint from the wrapped word-term sum and the record's position."""
    return splitmix64(acc ^ splitmix64(positions ^ _c(FP_POS_SEED)))
