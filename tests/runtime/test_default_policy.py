"""The default fingerprint policy's building blocks: rotating layers, the HEAD seal, knobs (docs/defaults.md)."""

from __future__ import annotations

import pytest
import torch
from kvcanary.config import CanaryConfig, HalfCoverage, LayerCoverage
from kvcanary.errors import CanaryInputError, KVCanaryError
from kvcanary.ops.fingerprint import fingerprint
from kvcanary.ops.plan import plan_forward
from kvcanary.ops.types import Fingerprint, FingerprintSources, GroupView, Sink, SourceSpec
from kvcanary.ops.write import write
from kvcanary_schema import (
    DEFAULT_SWEEP_SLICE,
    NUM_PLAN_COLS,
    NUM_PLAN_STATUS_COLS,
    FingerprintMode,
    RecordField,
    Stage,
)


def test_defaults_are_the_policy() -> None:
    cfg = CanaryConfig()
    assert cfg.fingerprint == FingerprintMode.PARTIAL and cfg.layer_coverage == LayerCoverage.FIRST
    assert cfg.sealing and cfg.reuse_check and cfg.sweep_interval == 0 and cfg.sweep_slice == DEFAULT_SWEEP_SLICE
    assert cfg.layer_stride_for(7) == 1  # FIRST: the state hands the ops source 0 only
    assert cfg.replace(layer_coverage="rotate").layer_stride_for(7) == 7
    assert cfg.half_coverage == HalfCoverage.FIRST
    assert CanaryConfig.from_env({"KVCANARY_HALF_COVERAGE": "Each"}).half_coverage == HalfCoverage.EACH
    with pytest.raises(CanaryInputError, match="half_coverage"):
        CanaryConfig(half_coverage="v")  # type: ignore[arg-type]
    # per-forward already covers every byte: no seal (with V's bytes too, half_coverage each)
    assert not cfg.replace(fingerprint="all", layer_coverage="all", half_coverage="each").sealing
    assert cfg.replace(fingerprint="all", layer_coverage="all").sealing
    assert not cfg.replace(fingerprint="none").sealing and not cfg.replace(seal=False).sealing
    env = CanaryConfig.from_env({"KVCANARY_SEAL": "0", "KVCANARY_SWEEP_SLICE": "64", "KVCANARY_REUSE_CHECK": "off"})
    assert not env.seal and env.sweep_slice == 64 and not env.reuse_check
    with pytest.raises(CanaryInputError, match="sweep_slice"):
        CanaryConfig(sweep_slice=10, sweep_capacity=8)


def _sources(n: int, slots: int = 16, row: int = 64, seed: int = 0) -> tuple[FingerprintSources, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    layers = [torch.randint(0, 256, (slots, row), dtype=torch.uint8, generator=g) for _ in range(n)]
    return FingerprintSources([[SourceSpec(t) for t in layers]], slots), layers


@pytest.mark.parametrize("n", [1, 3, 4])
def test_rotate_hashes_exactly_one_layer_per_position(n: int) -> None:
    """Position p reads the first 16 bytes of layer (-p) mod n only: a change anywhere else leaves it unchanged."""
    src, layers = _sources(n)
    slots = torch.full((2 * n,), 5)
    pos = torch.arange(2 * n)
    before = fingerprint(src, 0, slots, pos, FingerprintMode.PARTIAL, n)
    for j in range(n):
        for byte, hashed_bytes in ((3, True), (40, False)):
            layers[j][5, byte] ^= 1
            after = fingerprint(src, 0, slots, pos, FingerprintMode.PARTIAL, n)
            layers[j][5, byte] ^= 1
            changed = (after != before).tolist()
            assert changed == [hashed_bytes and (j + p) % n == 0 for p in range(2 * n)]


def new_plan(cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(cap, NUM_PLAN_COLS, dtype=torch.int64), torch.zeros(NUM_PLAN_STATUS_COLS, dtype=torch.int64)


def _backends() -> list[str]:
    try:
        from kvcanary import _native
        _native.module("cpu")
        return ["torch", "cpu"]
    except KVCanaryError:
        return ["torch"]


def test_head_seal_write_matches_across_backends_and_hashes_every_byte() -> None:
    """A HEAD write may carry the seal (ALL over every layer); backends agree bit for bit, and the stored value is
    the fingerprint op's."""
    src, layers = _sources(3)
    seal = Fingerprint(src, FingerprintMode.ALL)
    table = torch.arange(1, 9, dtype=torch.int64).view(1, 8)
    ids, pos, loc = torch.arange(100, 108), torch.arange(8), table[0].clone()
    out = {}
    for b in _backends():
        plan, status = new_plan(1)
        plan_forward(plan, status, torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                     torch.full((1,), 8), table, 8, backend=b)
        group = GroupView(torch.zeros(16, 1, 4, dtype=torch.int64))
        write(group, Stage.HEAD, plan, status, table, ids, pos, loc, Sink.allocate(4), fingerprint=seal, backend=b)
        out[b] = group.records
    ref = out["torch"]
    assert all(torch.equal(ref, r) for r in out.values())
    want = fingerprint(src, 0, loc, pos, FingerprintMode.ALL)
    assert torch.equal(ref[loc, 0, RecordField.KV_FINGERPRINT], want)
    layers[2][4, 63] ^= 0x10  # the last byte of the last layer is part of the seal
    assert not torch.equal(fingerprint(src, 0, loc, pos, FingerprintMode.ALL), want)


def test_head_verify_still_takes_no_fingerprint() -> None:
    from kvcanary.ops.fingerprint import check_fingerprint
    src, _ = _sources(1)
    with pytest.raises(CanaryInputError, match="HEAD"):
        check_fingerprint(Fingerprint(src), GroupView(torch.zeros(16, 1, 4, dtype=torch.int64)), Stage.HEAD)
