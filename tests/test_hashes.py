"""Hash vectors computed independently with Python ints, and the torch and C++ versions against them."""

from __future__ import annotations

import random

import pytest
import torch
from kvcanary import _native
from kvcanary.ops import hashes as H
from kvcanary_schema import CHAIN_BASE, TOKEN_LIMIT

# Vigna's splitmix64 finalizer vectors (published with the reference implementation's test data).
SPLITMIX_VECTORS = [
    (1, 0x5692161D100B05E5),
    (0x9E3779B97F4A7C15, 0xE220A8397B1DCDAF),
    (0xDEADBEEFCAFEBABE, 0x7AD6664F09FFE52C),
    (0xFFFFFFFFFFFFFFFF, 0xB4D055FCF2CBBD7B),
    (0x8000000000000000, 0x25C26EA579CEA98A),
]


@pytest.mark.parametrize(("x", "want"), SPLITMIX_VECTORS)
def test_splitmix64_int_vectors(x: int, want: int) -> None:
    assert H.splitmix64_int(x) == want


def test_splitmix64_torch_and_native_match_ints() -> None:
    rng = random.Random(7)
    xs = [x for x, _ in SPLITMIX_VECTORS] + [rng.getrandbits(64) for _ in range(1000)]
    t = torch.tensor([H.to_i64(x) for x in xs], dtype=torch.int64)
    want = [H.splitmix64_int(x) for x in xs]
    assert [H.to_u64(v) for v in H.splitmix64(t).tolist()] == want
    out = torch.empty_like(t)
    _native.module("cpu").hash_splitmix64(t, out)
    assert [H.to_u64(v) for v in out.tolist()] == want


def test_chain_step_matches_ints_and_counts_bad_inputs() -> None:
    rng = random.Random(11)
    n = 500
    hs = [rng.getrandbits(64) for _ in range(n)]
    toks = [rng.randrange(TOKEN_LIMIT) for _ in range(n)]
    poss = [rng.randrange(TOKEN_LIMIT) for _ in range(n)]
    toks[3], poss[9] = -1, TOKEN_LIMIT  # two bad inputs
    h = torch.tensor([H.to_i64(x) for x in hs])
    t, p = torch.tensor(toks), torch.tensor(poss)
    out = torch.empty_like(h)
    errors = _native.module("cpu").hash_chain_step(h, t, p, out)
    assert errors == 2
    for i in range(n):
        if i in (3, 9):
            assert out[i].item() == 0
            continue
        want = (hs[i] * CHAIN_BASE + H.chain_g_int(toks[i], poss[i])) & H.U64
        assert H.to_u64(int(out[i])) == want
        assert H.to_u64(int(H.chain_step(h[i:i + 1], t[i:i + 1], p[i:i + 1]))) == want


def test_chain_hand_vector() -> None:
    # h_1 for token 10 at position 0, spelled out step by step from the DESIGN 4 definition.
    h0 = H.splitmix64_int(0x6B7663616E617279)
    g = H.splitmix64_int(((0 << 32) | 10) ^ 0x4B56636861696E21)
    assert H.CHAIN_H0 == h0
    assert H.chain_step_int(h0, 10, 0) == (h0 * 0x9E3779B97F4A7C15 + g) % (1 << 64)


def test_native_rejects_bad_arguments() -> None:
    mod = _native.module("cpu")
    with pytest.raises(TypeError, match="int64"):
        mod.hash_splitmix64(torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="shape"):
        mod.hash_splitmix64(torch.zeros(4, dtype=torch.int64), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="contiguous"):
        mod.hash_splitmix64(torch.zeros(8, dtype=torch.int64)[::2], torch.zeros(4, dtype=torch.int64))
