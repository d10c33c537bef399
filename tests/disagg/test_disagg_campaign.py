"""The whole ``--fault all`` campaign over gloo (CPU): every fault as README's table says, within its bound."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from kvcanary.disagg.__main__ import main
from kvcanary.disagg.campaign import judge
from kvcanary.disagg.engines import Workload
from kvcanary.disagg.launcher import LaunchConfig, launch
from kvcanary.disagg.transport import FaultName, FaultSpec

TRANSPORT_WORDS = ("gloo", "nccl", "pair.cc", "/", "[", "Traceback")
MP_HELPERS = ("forkserver", "resource_tracker")


def _running(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _descendants(root: int) -> dict[int, tuple[int, str]]:
    """Running processes below ``root``: their parent and command line."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier} - found
        found |= frontier
    out = {}
    for pid in found:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError):
            continue
        if _running(pid):
            out[pid] = (parent[pid], cmd)
    return out


def _no_role_left(result: dict[str, Any]) -> None:
    pids = [pid for run in result["runs"] for pid in run["pids"].values()]
    deadline = time.monotonic() + 5.0  # the forkserver reaps its children asynchronously
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in pids if _running(pid)]
    others = {pid: cmd for pid, (_, cmd) in _descendants(os.getpid()).items() if not any(h in cmd for h in MP_HELPERS)}
    assert others == {}


def test_whole_fault_campaign_passes_within_its_bound(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "campaign.json"
    t0 = time.monotonic()
    rc = main(["--fault", "all", "--model", "swa", "--requests", "4", "--out", str(out)])
    wall = time.monotonic() - t0
    result = json.loads(out.read_text())
    rows = result["campaign"]
    assert [row["fault"] for row in rows] == [f.value for f in FaultName if f != FaultName.NONE]
    assert [row["outcome"] for row in rows] == ["pass"] * len(rows), rows
    assert rc == 0
    assert all(row["seconds"] <= row["bound_s"] for row in rows) and wall <= result["bound_s"]
    text = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in text[:len(rows)]] == [row["fault"] for row in rows]
    assert text[len(rows)].startswith(f"campaign: {len(rows)}/{len(rows)} pass")
    for run in result["runs"]:
        for role, err in run["errors"].items():
            if err is not None:  # one line: role, step, typed cause; transport text only in the detail
                assert err["message"].startswith(f"{role}: ") and "\n" not in err["message"]
                assert not any(w in err["message"] for w in TRANSPORT_WORDS), err["message"]
    lost = next(r for r in result["runs"] if r["fault"] == "kill_prefill")["errors"]["decode"]
    assert lost["message"] == "decode: receive the payload of req1: prefill is gone" and "gloo" in lost["detail"]
    _no_role_left(result)


def test_campaign_judge_fails_a_fault_that_goes_undetected() -> None:
    """Negative control: without token truth a swap decodes silently, and the campaign's verdict says so."""
    r = launch(LaunchConfig(model="full", workload=Workload(4, 20, 20, 4, seed=3), fault=FaultSpec(FaultName.SWAP),
                            token_truth="off", timeout_s=2.0, idle_timeout_s=5.0, start_method="forkserver"))
    row = judge(r)
    assert row["outcome"].startswith("FAIL: req1 not caught by") and row["check"] == "not detected"



def test_roles_die_with_a_killed_launcher() -> None:
    """A launcher killed mid-run (e.g. by a script's time limit) leaves no role behind: they die with their parent."""
    cmd = [sys.executable, "-m", "kvcanary.disagg", "--fault", "stall_decode", "--target", "0", "--timeout", "30",
           "--idle-timeout", "60", "--start-method", "forkserver"]
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    roles: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while len(roles) < 2 and time.monotonic() < deadline:  # the roles are the forkserver's children
            time.sleep(0.2)
            roles = {pid for pid, (ppid, _) in _descendants(launcher.pid).items() if ppid != launcher.pid}
        assert len(roles) == 2, _descendants(launcher.pid)
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.monotonic() + 20
    while any(_running(pid) for pid in roles) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in roles if _running(pid)], {pid: _running(pid) for pid in roles}
