"""Token truth on the host (docs/ops-contract.md 8): the incremental chain hasher behind EXPECT_PREFIX / EXPECT_NEW."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from kvcanary_schema import CHAIN_BASE, TOKEN_LIMIT

from kvcanary.errors import CanaryInputError
from kvcanary.ops import hashes as H
from kvcanary.ops.write import powers

Tokens = Sequence[int] | torch.Tensor

# Below this many new tokens Python ints beat a torch launch sequence.
_TORCH_MIN_TOKENS = 64


def fold(h: int, tokens: Tokens, first_position: int) -> int:
    """Chain value (u64) after folding ``tokens`` at positions ``first_position, first_position + 1...`` into ``h``."""
    t = tokens.detach().to("cpu", torch.int64).reshape(-1) if isinstance(tokens, torch.Tensor) else None
    n = t.shape[0] if t is not None else len(tokens)
    if n == 0:
        return h & H.U64
    if first_position < 0 or first_position + n > TOKEN_LIMIT:
        raise CanaryInputError(f"positions [{first_position}, {first_position + n}) outside [0, {TOKEN_LIMIT})")
    if n < _TORCH_MIN_TOKENS:
        vals = t.tolist() if t is not None else list(tokens)
        for i, tok in enumerate(vals):
            h = H.chain_step_int(h, int(tok), first_position + i)  # raises CanaryInputError on a bad token
        return h
    if t is None:
        t = torch.tensor(list(tokens), dtype=torch.int64)
    if not bool(H.chain_value_ok(t).all()):
        raise CanaryInputError(f"tokens must lie in [0, {TOKEN_LIMIT})")
    # h_n = B^n h + sum_i g_i B^(n-1-i): one wrapping dot product.
    g = H.chain_g(t, torch.arange(first_position, first_position + n, dtype=torch.int64))
    pw = powers(CHAIN_BASE, n + 1, t.device)
    tail = int((g * pw[:n].flip(0)).sum())
    return (h * H.to_u64(int(pw[n])) + tail) & H.U64


class ChainHasher:
    """Per request key, the chain value of its true history so far, extended in O(new tokens).

    With ``offset`` o (a draft pool, e.g. EAGLE's o = 1), the tracked history holds at position p the true token of
    position p + o: the true tokens of positions < o are not part of it.
    """

    def __init__(self, offset: int = 0) -> None:
        """A hasher with no requests; ``offset`` >= 0 shifts the history as described above."""
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise CanaryInputError(f"offset must be an int >= 0, got {offset!r}")
        self.offset = offset
        self._state: dict[Hashable, tuple[int, int]] = {}  # key -> (h as u64, true tokens consumed)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._state

    def __len__(self) -> int:
        return len(self._state)

    def length(self, key: Hashable) -> int:
        """True tokens of ``key`` consumed so far (0 for an unknown key)."""
        return self._state.get(key, (H.CHAIN_H0, 0))[1]

    def value(self, key: Hashable) -> int:
        """Chain value (u64) of ``key``'s history; h_0 for an unknown key (empty history)."""
        return self._state.get(key, (H.CHAIN_H0, 0))[0]

    def extend(self, key: Hashable, tokens: Tokens, start_position: int) -> int:
        """Append the true tokens of positions ``start_position...`` (must equal :meth:`length`); returns the u64."""
        h, n = self._state.get(key, (H.CHAIN_H0, 0))
        if start_position != n:
            raise CanaryInputError(f"request {key!r}: extend at {start_position}, but {n} tokens are known "
                                   f"(drop() and re-extend to rewrite history)")
        count = tokens.numel() if isinstance(tokens, torch.Tensor) else len(tokens)
        skip = max(0, self.offset - start_position)  # true positions < offset have no place in the history
        if skip:
            tokens = tokens.reshape(-1)[skip:] if isinstance(tokens, torch.Tensor) else tokens[skip:]
        h = fold(h, tokens, start_position + skip - self.offset)
        self._state[key] = (h, n + count)
        return h

    def drop(self, key: Hashable) -> None:
        """Forget ``key`` (finished or retracted request); unknown keys are ignored."""
        self._state.pop(key, None)

    def values(self, keys: Sequence[Hashable], device: torch.device | str = "cpu") -> torch.Tensor:
        """int64 tensor of the keys' chain values as stored in records and plans (u64 bit-cast)."""
        return torch.tensor([H.to_i64(self.value(k)) for k in keys], dtype=torch.int64, device=device)

    def extend_batch(self, keys: Sequence[Hashable], tokens: Sequence[Tokens], start_positions: Sequence[int],
                     device: torch.device | str = "cpu") -> torch.Tensor:
        """:meth:`extend` for each request in order; int64 tensor of the new chain values (u64 bit-cast)."""
        if not len(keys) == len(tokens) == len(start_positions):
            raise CanaryInputError("keys, tokens and start_positions must have the same length")
        new = [H.to_i64(self.extend(k, t, s)) for k, t, s in zip(keys, tokens, start_positions, strict=True)]
        return torch.tensor(new, dtype=torch.int64, device=device)


def chain_truth(hasher: ChainHasher, key: Hashable, history: Sequence[int], prefix_len: int, extend_len: int,
                offset: int = 0) -> tuple[int | None, int | None]:
    """Expected chain values (int64 bit-cast) of one request's forward, from its true ``history`` (prompt + committed
    outputs), advancing ``hasher`` in O(new tokens): ``(expect_prefix, expect_new)``, each None where unknown (no
    prefix, history not yet known that far, or a prefix the hasher cannot reach). A rewound history (retract,
    rollback) is rebuilt once."""
    known = len(history)
    want_pre, want_new = prefix_len + offset, prefix_len + extend_len + offset
    n = hasher.length(key)
    if n > want_pre:
        hasher.drop(key)
        n = 0
    reach = min(known, want_pre)
    h = hasher.extend(key, history[n:reach], n) if reach > n else hasher.value(key)
    at_pre = max(n, reach) == want_pre
    ep = H.to_i64(h) if prefix_len > 0 and at_pre else None
    en = None
    if extend_len > 0 and known >= want_new and at_pre:
        en = H.to_i64(hasher.extend(key, history[want_pre:want_new], want_pre))
    return ep, en
