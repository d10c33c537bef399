"""Two GPUs, NCCL payloads (gloo control): relocation, in-transit faults, dead peers (gpu/run_disagg_gpu.sh tests)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from kvcanary.disagg.engines import Workload
from kvcanary.disagg.launcher import LaunchConfig, launch
from kvcanary.disagg.transport import FaultName, FaultSpec

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one per role)")]


def run(model: str, fault: FaultName = FaultName.NONE, target: int = 1, **kw: Any) -> dict[str, Any]:
    """One launch on cuda:0 (prefill) and cuda:1 (decode)."""
    kw = {"timeout_s": 8.0, "idle_timeout_s": 12.0, **kw}
    return launch(LaunchConfig(device="cuda", model=model, workload=Workload(4, 20, 20, 4, seed=3),
                               fault=FaultSpec(fault, target, seed=5), **kw))


@pytest.mark.parametrize("model", ["full", "swa"])
def test_clean_over_nccl(model: str) -> None:
    r = run(model)
    assert len(r["ok"]) == 4 and r["failed"] == {} and r["outputs_match_reference"] is True
    assert r["prefill_violations"] == 0 and r["decode_violations"] == 0
    assert r["errors"] == {"prefill": None, "decode": None}


@pytest.mark.parametrize("fault,reason", [(FaultName.CORRUPT, "verify_fingerprint"),
                                          (FaultName.TRUNCATE_LAYERS, "verify_fingerprint"),
                                          (FaultName.TRUNCATE_TAIL, "verify_chain"),
                                          (FaultName.SWAP, "verify_token"),
                                          (FaultName.STALE, "verify_token")])
def test_in_transit_faults_over_nccl(fault: FaultName, reason: str) -> None:
    r = run("swa", fault)
    victims = ["req1", "req2"] if fault == FaultName.SWAP else ["req1"]
    assert r["failed"] == {rid: "canary" for rid in victims}
    assert all(any(k.endswith(":" + reason) for k in r["detected"][rid]) for rid in victims)
    assert r["prefill_violations"] == 0 and r["errors"] == {"prefill": None, "decode": None}


def test_dead_peers_over_nccl() -> None:
    r = run("full", FaultName.KILL_DECODE)
    assert r["errors"]["prefill"]["type"] == "PeerLostError" and r["exitcodes"]["decode"] == 3
    # the payload receive is pending on NCCL, which never notices a dead peer: the control reader does, at once
    r = run("full", FaultName.KILL_PREFILL, timeout_s=30.0, idle_timeout_s=30.0)
    assert r["exitcodes"]["decode"] != "hung", r["hang_stacks"]["decode"]  # where it hung (launcher.stacks_of_hung)
    assert r["errors"]["decode"]["type"] == "PeerLostError"
    assert r["errors"]["decode"]["message"] == "decode: receive the payload of req1: prefill is gone"
    assert r["seconds"]["decode"] < 30.0 and r["exitcodes"] == {"prefill": 3, "decode": 0} and r["ok"] == ["req0"]

