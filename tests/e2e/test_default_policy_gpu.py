"""The default policy on CUDA (cuda backend): the seal write matches the reference, bit rot is caught, quarantine."""

from __future__ import annotations

import pytest
import torch
from kvcanary import campaign as C
from kvcanary.ops.fingerprint import fingerprint
from kvcanary.ops.plan import plan_forward
from kvcanary.ops.types import Fingerprint, FingerprintSources, GroupView, Sink, SourceSpec
from kvcanary.ops.write import write
from kvcanary_schema import NUM_PLAN_COLS, NUM_PLAN_STATUS_COLS, FingerprintMode, RecordField, Stage

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_head_seal_write_on_cuda_matches_the_reference() -> None:
    g = torch.Generator(device="cuda").manual_seed(3)
    layers = [torch.randint(0, 256, (4096, 256), dtype=torch.uint8, device="cuda", generator=g) for _ in range(3)]
    seal = Fingerprint(FingerprintSources([[SourceSpec(t) for t in layers]] * 2, 4096), FingerprintMode.ALL)
    table = (torch.randperm(4095, device="cuda", generator=g)[:2048] + 1).view(2, 1024)
    ids = torch.randint(0, 1000, (2048,), device="cuda", generator=g)
    pos = torch.arange(1024, device="cuda").repeat(2)
    out = {}
    for backend in ("torch", "cuda"):
        plan = torch.zeros(2, NUM_PLAN_COLS, dtype=torch.int64, device="cuda")
        status = torch.zeros(NUM_PLAN_STATUS_COLS, dtype=torch.int64, device="cuda")
        z = torch.zeros(2, dtype=torch.int64, device="cuda")
        plan_forward(plan, status, torch.arange(2, device="cuda"), z, torch.full_like(z, 1024), table, 2048,
                     backend=backend)
        group = GroupView(torch.zeros(4096, 2, 4, dtype=torch.int64, device="cuda"))
        write(group, Stage.HEAD, plan, status, table, ids, pos, table.reshape(-1), Sink.allocate(4, "cuda"),
              fingerprint=seal, backend=backend)
        out[backend] = group.records
    assert torch.equal(out["torch"], out["cuda"])
    loc = table.reshape(-1)
    assert torch.equal(out["cuda"][loc, 1, RecordField.KV_FINGERPRINT],
                       fingerprint(seal.sources, 1, loc, pos, FingerprintMode.ALL, backend="cuda"))


@pytest.mark.parametrize("name", ["cached_kv_flip_reused", "cached_kv_flip_idle", "padding_write_live_slot",
                                  "perturb:real_kv_unused_cached"])
def test_default_policy_on_cuda(name: str) -> None:
    case = C.CASES_BY_NAME[name]
    for seed in range(6):
        trial = C.run_trial(case, seed, "cuda", "cuda", policy="default")
        if trial.fired:
            break
    assert trial.ok, trial


def test_clean_default_run_on_cuda() -> None:
    res = C.run_clean(3, 24, "cuda", "cuda", config=C.default_config("cuda"))
    assert res.violations == 0 and res.input_errors == 0 and res.forwards > 50
