"""End to end: prefill and decode roles in two processes over gloo (loopback); faults in transit, dead peers."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp
from kvcanary.disagg.engines import Workload, model_config
from kvcanary.disagg.launcher import LaunchConfig, launch, stacks_of_hung, stacks_on_signal
from kvcanary.disagg.transport import FaultName, FaultSpec
from kvcanary_schema import RECORD_BYTES

REQUESTS = 4


def run(model: str = "full", fault: FaultName = FaultName.NONE, target: int = 1, timeout_s: float = 5.0,
        workload: Workload | None = None, **kw: Any) -> dict[str, Any]:
    """One launch; forkserver keeps each launch around a second (torch is imported once)."""
    cfg = LaunchConfig(model=model, workload=workload or Workload(REQUESTS, 20, 20, 4, seed=3),
                       fault=FaultSpec(fault, target, seed=5), timeout_s=timeout_s, start_method="forkserver", **kw)
    return launch(cfg)


def _expected_bytes(model: str, workload: Workload, result: dict[str, Any]) -> tuple[int, int]:
    """KV and canary bytes of the workload's transfers, from the model shape (independent of the layout code)."""
    m = model_config(model)
    row = m.num_kv_heads * m.head_dim * m.dtype.itemsize
    transfers = len(result["ok"]) + len(result["failed"])
    n = workload.min_len  # fixed-length prompts in these tests
    w = min(n, m.sliding_window - 1) if m.sliding_layers else 0  # the engine keeps W-1 positions resident
    kv = 2 * row * (n * len(m.full_layers) + w * len(m.sliding_layers))
    canary = 2 * 2 * RECORD_BYTES * (n + w)  # HEAD+TAIL x (K,V records), per FULL position and SWA row
    return transfers * kv, transfers * canary


@pytest.mark.parametrize("model", ["full", "swa"])
def test_clean_transfer_relocates_and_decodes_identically(model: str) -> None:
    wl = Workload(REQUESTS, 20, 20, 5, seed=7)
    r = run(model, workload=wl)
    assert r["ok"] == [f"req{i}" for i in range(REQUESTS)] and r["failed"] == {}
    assert r["prefill_violations"] == 0 and r["decode_violations"] == 0
    assert r["outputs_match_reference"] is True
    assert r["errors"] == {"prefill": None, "decode": None} and r["exitcodes"] == {"prefill": 0, "decode": 0}
    kv, canary = _expected_bytes(model, wl, r)
    assert r["overhead"]["kv_bytes"] == kv and r["overhead"]["canary_bytes"] == canary
    assert r["overhead"]["canary_pct_of_kv"] == round(100 * canary / kv, 3)


def test_clean_paged_pool_variable_lengths() -> None:
    r = run("swa", workload=Workload(REQUESTS, 5, 33, 4, seed=2), page_size=4)
    assert len(r["ok"]) == REQUESTS and r["failed"] == {} and r["outputs_match_reference"] is True
    assert r["prefill_violations"] == 0 and r["decode_violations"] == 0


def test_clean_variable_lengths_without_canary() -> None:
    r = run("swa", workload=Workload(REQUESTS, 3, 30, 4, seed=1), canary=False)
    assert len(r["ok"]) == REQUESTS and r["outputs_match_reference"] is True
    assert r["overhead"]["canary_bytes"] == 0 and r["decode_violations"] == 0


def _reasons(r: dict[str, Any], rid: str) -> set[tuple[str, str]]:
    return {tuple(k.split(":")) for k in r["violations_by_request"].get(rid, [])}  # type: ignore[misc]


def _assert_contained(r: dict[str, Any], victims: list[str]) -> None:
    """Only the victims fail (by the canary); everyone else decodes the reference output; prefill stays clean."""
    assert r["victims"] == victims
    assert r["failed"] == {rid: "canary" for rid in victims}
    assert sorted(r["ok"]) == sorted(f"req{i}" for i in range(REQUESTS) if f"req{i}" not in victims)
    assert set(r["violations_by_request"]) == set(victims)
    assert r["prefill_violations"] == 0
    assert r["outputs_match_reference"] is True
    assert r["errors"] == {"prefill": None, "decode": None}


@pytest.mark.parametrize("model", ["full", "swa"])
def test_flipped_byte_in_transit_is_a_fingerprint_violation(model: str) -> None:
    r = run(model, FaultName.CORRUPT, target=2)
    _assert_contained(r, ["req2"])
    flipped = r["faults_fired"][0]["flipped"]
    group = "SWA" if int(flipped["item"][4:]) in model_config(model).sliding_layers else "FULL"
    half = flipped["item"][3].upper()
    assert _reasons(r, "req2") == {(f"TAIL_{half}_{group}", "verify_fingerprint")}


@pytest.mark.parametrize("model", ["full", "swa"])
def test_missing_last_layers_are_fingerprint_violations(model: str) -> None:
    r = run(model, FaultName.TRUNCATE_LAYERS, target=1)
    _assert_contained(r, ["req1"])
    last = model_config(model).num_layers - 1
    group = "SWA" if last in model_config(model).sliding_layers else "FULL"
    assert _reasons(r, "req1") == {(f"TAIL_K_{group}", "verify_fingerprint"), (f"TAIL_V_{group}", "verify_fingerprint")}


@pytest.mark.parametrize("model", ["full", "swa"])
def test_missing_tail_buffers_break_tail_chain_and_position(model: str) -> None:
    r = run(model, FaultName.TRUNCATE_TAIL, target=0)
    _assert_contained(r, ["req0"])
    got = _reasons(r, "req0")
    assert all(tag.startswith("TAIL_") for tag, _ in got)  # HEAD records arrived: HEAD stays clean
    for group in ["FULL"] + (["SWA"] if model == "swa" else []):
        for half in "KV":
            assert {(f"TAIL_{half}_{group}", "verify_chain"), (f"TAIL_{half}_{group}", "verify_position")} <= got


def _token_truth_only(r: dict[str, Any], rid: str, model: str) -> None:
    """A self-consistent foreign chain: only token truth (HEAD and TAIL, every group and half) sees it."""
    got = _reasons(r, rid)
    assert {reason for _, reason in got} == {"verify_token", "write_token"}
    groups = ["FULL"] + (["SWA"] if model == "swa" else [])
    assert {tag for tag, _ in got} == {f"{s}_{h}_{g}" for s in ("HEAD", "TAIL") for h in "KV" for g in groups}


@pytest.mark.parametrize("model", ["full", "swa"])
def test_swapped_requests_are_caught_by_token_truth(model: str) -> None:
    r = run(model, FaultName.SWAP, target=1)
    _assert_contained(r, ["req1", "req2"])
    for rid in ("req1", "req2"):
        _token_truth_only(r, rid, model)


@pytest.mark.parametrize("model", ["full", "swa"])
def test_stale_transfer_is_caught_by_token_truth(model: str) -> None:
    r = run(model, FaultName.STALE, target=3)
    _assert_contained(r, ["req3"])
    assert r["faults_fired"][0]["stale_from"] == 2
    _token_truth_only(r, "req3", model)


@pytest.mark.parametrize("fault", [FaultName.SWAP, FaultName.STALE])
def test_foreign_chains_need_token_truth(fault: FaultName) -> None:
    """Negative control: without token truth the swapped/stale KV is decoded silently into wrong outputs."""
    r = run("full", fault, target=1, token_truth="off")
    assert r["failed"] == {} and r["decode_violations"] == 0
    assert r["outputs_match_reference"] is False


def test_expected_token_pool_also_catches_a_swap() -> None:
    r = run("swa", FaultName.SWAP, target=1, token_truth="pool")
    _assert_contained(r, ["req1", "req2"])
    assert all(reason in ("verify_token", "write_token") for _, reason in _reasons(r, "req1"))


def test_truncated_layers_need_all_layer_coverage() -> None:
    """Negative control: fingerprints of the first layer only cannot see that the last layer never arrived (and the
    greedy outputs need not change either: the zeroed layer goes unnoticed end to end)."""
    r = run("full", FaultName.TRUNCATE_LAYERS, target=1, layer_coverage="first")
    assert r["faults_fired"][0]["missing"] == ["kv.k2", "kv.v2"]
    assert r["failed"] == {} and r["decode_violations"] == 0


def test_bad_length_rejects_only_that_request() -> None:
    r = run("full", FaultName.BAD_LENGTH, target=1)
    assert r["failed"] == {"req1": "rejected"}
    assert sorted(r["ok"]) == ["req0", "req2", "req3"] and r["outputs_match_reference"] is True
    assert r["errors"] == {"prefill": None, "decode": None} and r["decode_violations"] == 0


def test_corrupted_header_is_a_protocol_error_on_both_sides() -> None:
    r = run("full", FaultName.BAD_HEADER, target=2)
    assert r["errors"]["decode"]["type"] == "TransferProtocolError" and "checksum" in r["errors"]["decode"]["message"]
    assert r["errors"]["prefill"]["type"] == "TransferProtocolError"
    assert sorted(r["ok"]) == ["req0", "req1"] and r["outputs_match_reference"] is True
    assert set(r["failed"]) == {"req2", "req3"}
    assert r["exitcodes"] == {"prefill": 0, "decode": 0}


def test_dead_decode_peer_is_a_typed_error_not_a_hang() -> None:
    r = run("full", FaultName.KILL_DECODE, target=1, timeout_s=20.0)
    # a closed connection is seen at once: prefill's serving time (process start excluded) stays far below 20 s
    assert r["seconds"]["prefill"] < 10
    assert r["errors"]["prefill"]["type"] == "PeerLostError"
    assert r["exitcodes"] == {"prefill": 0, "decode": 3}
    assert r["failed"]["req0"] == "decode role died" and set(r["failed"]) == {f"req{i}" for i in range(REQUESTS)}


def test_dead_prefill_peer_fails_its_request_and_decode_finishes_the_rest() -> None:
    r = run("swa", FaultName.KILL_PREFILL, target=2, timeout_s=20.0)
    assert r["seconds"]["decode"] < 10  # seen at once, long before the 20 s payload timeout (process start excluded)
    assert r["errors"]["decode"]["type"] == "PeerLostError"
    assert r["errors"]["decode"]["message"] == "decode: receive the payload of req2: prefill is gone"
    assert r["exitcodes"] == {"prefill": 3, "decode": 0}
    assert sorted(r["ok"]) == ["req0", "req1"] and r["outputs_match_reference"] is True
    assert r["failed"]["req2"] == "transfer stopped: PeerLostError"
    assert r["decode_violations"] == 0


def test_silent_peer_times_out() -> None:
    r = run("full", FaultName.STALL_DECODE, target=0, timeout_s=1.0, idle_timeout_s=2.0)
    assert r["errors"]["prefill"]["type"] == "TransferTimeoutError"
    assert r["errors"]["prefill"]["message"] == "prefill: wait for the GRANT of req0: no message from decode within 2 s"
    # the stalled decode side learns from the ABORT that prefill gave up, instead of sleeping out its stall
    assert r["errors"]["decode"]["type"] == "PeerLostError"
    assert r["errors"]["decode"]["message"] == "decode: send the GRANT of req0: prefill gave up (TIMEOUT)"
    assert r["seconds"]["decode"] < 2.0 + 1.0 + r["seconds"]["prefill"]
    assert r["ok"] == [] and set(r["failed"]) == {f"req{i}" for i in range(REQUESTS)}
    assert r["exitcodes"] == {"prefill": 0, "decode": 0} and r["wall_s"] < r["bound_s"]


def _blocked_role(path: str) -> None:
    stacks_on_signal(path)
    threading.Event().wait()  # blocks for good, as a role stuck on a dead peer would


def test_a_hung_role_is_killed_with_its_stacks(tmp_path: Path) -> None:
    path = str(tmp_path / "role.stacks")
    p = mp.get_context("spawn").Process(target=_blocked_role, args=(path,), daemon=True)
    p.start()
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:  # registered (the spawn imports first)
        time.sleep(0.05)
    stacks = stacks_of_hung(p, path)
    assert not p.is_alive() and p.exitcode == -signal.SIGKILL
    assert "in _blocked_role" in stacks and "in wait" in stacks
