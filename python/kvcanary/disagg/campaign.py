"""Fault campaign: every fault once, short explicit timeouts, one judged line per fault (fault, outcome, check, s)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .transport import FaultName

CAMPAIGN_TIMEOUT_S = 2.0  # a transfer step (serving default: 10 s)
CAMPAIGN_IDLE_S = 5.0  # the next OFFER / a GRANT (serving default: 6 x the step timeout)
CAMPAIGN_STARTUP_S = 30.0  # starting both roles, the 4-request workload and the reference run, per fault
EXIT_KILLED = 3  # exit code of a role the kill faults end (os._exit in prefill.py / decode.py)


@dataclass(frozen=True)
class Expect:
    """What README.md's fault table says catches a fault: a canary check on the victims, a REJECT, or typed
    errors per role (None: no error) and the exit codes (0 unless the fault kills that role)."""

    checks: tuple[str, ...] = ()  # canary reasons; every victim must show one of them
    rejected: bool = False
    prefill_error: str | None = None
    decode_error: str | None = None
    killed: str | None = None  # the role the fault kills


EXPECT: dict[FaultName, Expect] = {
    FaultName.NONE: Expect(),
    FaultName.CORRUPT: Expect(checks=("verify_fingerprint",)),
    FaultName.TRUNCATE_LAYERS: Expect(checks=("verify_fingerprint",)),
    FaultName.TRUNCATE_TAIL: Expect(checks=("verify_chain",)),
    # a swap of two prompts of different lengths leaves the longer one's own rows after the foreign ones: its
    # chain breaks at the seam before token truth gets to a row
    FaultName.SWAP: Expect(checks=("verify_token", "verify_chain")),
    FaultName.STALE: Expect(checks=("verify_token",)),
    FaultName.BAD_LENGTH: Expect(rejected=True),
    FaultName.BAD_HEADER: Expect(prefill_error="TransferProtocolError", decode_error="TransferProtocolError"),
    FaultName.STALL_DECODE: Expect(prefill_error="TransferTimeoutError", decode_error="PeerLostError"),
    FaultName.KILL_DECODE: Expect(prefill_error="PeerLostError", killed="decode"),
    FaultName.KILL_PREFILL: Expect(decode_error="PeerLostError", killed="prefill"),
}


def _error_type(r: dict[str, Any], role: str) -> str | None:
    err = r["errors"][role]
    return None if err is None else str(err["type"])


def _caught(keys: list[str], checks: tuple[str, ...]) -> list[str]:
    """The ``TAG:reason`` keys whose reason is one of ``checks``."""
    return [k for k in keys if k.rpartition(":")[2] in checks]


def _problems(r: dict[str, Any], want: Expect) -> list[str]:
    """Where a run differs from what the fault table predicts (empty: as predicted)."""
    bad = []
    for role in ("prefill", "decode"):
        expected_exit = EXIT_KILLED if want.killed == role else 0
        if r["exitcodes"][role] != expected_exit:
            bad.append(f"{role} exit {r['exitcodes'][role]}")
        if want.killed != role and _error_type(r, role) != getattr(want, f"{role}_error"):
            bad.append(f"{role} error {_error_type(r, role)}")
    victims = r["victims"]
    if want.checks:
        bad += [f"{rid} not caught by {'/'.join(want.checks)}" for rid in victims
                if r["failed"].get(rid) != "canary" or not _caught(r["detected"][rid], want.checks)]
    if want.rejected:
        bad += [f"{rid} not rejected" for rid in victims if r["failed"].get(rid) != "rejected"]
    if want.checks or want.rejected:
        if set(r["failed"]) != set(victims) or r["outputs_match_reference"] is not True:
            bad.append("requests other than the victims failed or decoded differently")
        if r["prefill_violations"]:
            bad.append("violations on the prefill side")
    if r["wall_s"] is not None and r["wall_s"] > r["bound_s"]:
        bad.append(f"took {r['wall_s']:.1f} s > bound {r['bound_s']:g} s")
    return bad


def _check(r: dict[str, Any], want: Expect) -> str:
    """The detection (canary reasons of the victims, REJECT) or the typed errors, in one line."""
    if want.checks:
        keys = sorted({k for rid in r["victims"] for k in _caught(r["detected"][rid], want.checks)})
        return ", ".join(keys) or "not detected"
    if want.rejected:
        return "REJECT " + ", ".join(f"{rid}: {r['failed'].get(rid)}" for rid in r["victims"])
    return error_line(r)


def error_line(r: dict[str, Any]) -> str:
    """Each role's error as "TYPE: message", one line (the transport's own text stays in the JSON's detail)."""
    return " | ".join(f"{e['type']}: {e['message']}" for e in r["errors"].values() if e) or "no error"


def judge(r: dict[str, Any]) -> dict[str, Any]:
    """One campaign row: fault, outcome (pass / FAIL: why / hung), the check or error, seconds, the bound."""
    want = EXPECT[FaultName(r["fault"])]
    problems = _problems(r, want)
    hung = "hung" in r["exitcodes"].values()
    outcome = "hung" if hung else ("pass" if not problems else "FAIL: " + "; ".join(problems))
    return {"model": r["model"], "fault": r["fault"], "outcome": outcome, "check": _check(r, want),
            "seconds": r["wall_s"], "bound_s": r["bound_s"]}


def format_row(row: dict[str, Any]) -> str:
    """A campaign row as one text line."""
    return (f"{row['model']:<5} {row['fault']:<16} {row['outcome']:<6} {row['seconds']:7.2f} s "
            f"(bound {row['bound_s']:g} s)  {row['check']}")
