"""Prefill role: compute each prompt's KV, offer it to the decode role, send KV rows and canary records on GRANT."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from kvcanary_schema import Group

from kvcanary.engine.scheduler import ReqState, Request

from .canary import CanaryBinding, engine_layout
from .engines import PrefillEngine, request_key
from .errors import TransferError, TransferProtocolError, TransferRejectedError
from .layout import TransferLayout
from .transport import Channel, FaultName, FaultSpec, Message, MsgKind, Status


@dataclass
class RoleReport:
    """What a role did: per-request outcome, violations it found, fatal error (typed), byte counts."""

    role: str
    requests: dict[str, dict[str, Any]] = field(default_factory=dict)
    violations: list[dict[str, Any]] = field(default_factory=list)
    error: dict[str, str] | None = None
    transfers: int = 0
    payload_bytes: int = 0
    kv_bytes: int = 0
    canary_bytes: int = 0
    faults_fired: list[dict[str, object]] = field(default_factory=list)
    bytes_per_row: dict[str, dict[str, int]] = field(default_factory=dict)  # group -> {kv, canary} per slot
    outputs: dict[str, list[int]] = field(default_factory=dict)
    seconds: float = 0.0

    def fail(self, rid: str, reason: str, **extra: Any) -> None:
        """Mark a request failed (keeps the first reason)."""
        entry = self.requests.setdefault(rid, {})
        if entry.get("status") != "failed":
            entry.update(status="failed", reason=reason, **extra)

    def set_error(self, err: BaseException) -> None:
        """Record the fatal error that stopped the role."""
        self.error = {"type": type(err).__name__, "message": str(err)}

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return dict(vars(self))


def per_row(layout: TransferLayout) -> dict[str, dict[str, int]]:
    """KV and canary bytes one slot of each group adds to a transfer."""
    out = {}
    for group in Group:
        kv, canary = layout.row_bytes(group)
        if kv or canary:
            out[group.name] = {"kv": kv, "canary": canary}
    return out


def handshake(channel: Channel, layout: TransferLayout, first: bool) -> None:
    """Exchange HELLO with the layout digest; a mismatch is a protocol error on both sides."""
    mine = Message(MsgKind.HELLO, digest=layout.digest)
    if first:
        channel.send(mine)
    peer = channel.recv(MsgKind.HELLO, idle=True)
    if not first:
        channel.send(mine)
    if peer.digest != layout.digest:
        raise TransferProtocolError(f"transfer layouts differ: peer digest {peer.digest:#x}, "
                                    f"mine {layout.digest:#x}")


class PrefillRole:
    """Runs the prefill engine and transfers each request as soon as its first token is sampled."""

    def __init__(self, engine: PrefillEngine, canary: CanaryBinding | None, channel: Channel,
                 fault: FaultSpec) -> None:
        self.engine, self.canary, self.channel, self.fault = engine, canary, channel, fault
        self.layout = engine_layout(engine, canary)
        engine.on_prefilled = self._transfer
        self.report = RoleReport("prefill")
        self.report.bytes_per_row = per_row(self.layout)
        self._index = 0

    def run(self, requests: list[Request]) -> RoleReport:
        """Prefill every request (one output token each) and transfer it; BYE at the end."""
        t0 = time.perf_counter()
        for r in requests:
            self.report.requests[r.rid] = {"status": "pending"}
        try:
            handshake(self.channel, self.layout, first=True)
            self.engine.generate([Request(r.rid, r.prompt, 1, r.sampling) for r in requests])
            self.channel.send(Message(MsgKind.BYE))
        except TransferError as err:
            self.report.set_error(err)
            for rid, entry in self.report.requests.items():
                if entry.get("status") == "pending":
                    self.report.fail(rid, f"transfer stopped: {type(err).__name__}")
            self.channel.abort(Status.PROTOCOL if isinstance(err, TransferProtocolError) else Status.PEER_ERROR)
        finally:
            if self.canary is not None:
                self.report.violations = [v.to_dict() for v in self.canary.poll(final=True)]
            self.report.seconds = time.perf_counter() - t0
        return self.report

    def _transfer(self, engine: PrefillEngine, state: ReqState) -> None:
        index, self._index = self._index, self._index + 1
        full, swa = engine.transfer_slots(state)
        n, nswa = int(full.numel()), int(swa.numel())
        payload = self.layout.gather(full, swa)
        declared = int(payload.numel()) + (16 if self.fault.hits(FaultName.BAD_LENGTH, index) else 0)
        offer = Message(MsgKind.OFFER, req_key=request_key(state.rid), prefix_len=n, first_token=state.tokens[-1],
                        full_rows=n, swa_rows=nswa, payload_bytes=declared, digest=self.layout.digest,
                        body=tuple(state.req.prompt))
        self.channel.send(offer, corrupt_checksum=self.fault.hits(FaultName.BAD_HEADER, index))
        reply = self.channel.recv(MsgKind.GRANT, MsgKind.REJECT, idle=True)  # decode may first make room
        entry = self.report.requests[state.rid]
        entry.update(index=index, first_token=state.tokens[-1], prefix_len=n, swa_rows=nswa)
        if reply.kind == MsgKind.REJECT:
            err = TransferRejectedError(offer.req_key, reply.status, Status(reply.status).name)
            self.report.fail(state.rid, "rejected", error={"type": type(err).__name__, "message": str(err)})
            return
        if self.fault.hits(FaultName.KILL_PREFILL, index):
            os._exit(3)  # the fault: this process dies between GRANT and payload
        self.channel.send_payload(payload)
        ack = self.channel.recv(MsgKind.ACK)
        kv, canary = self.layout.split_bytes(n, nswa)
        self.report.transfers += 1
        self.report.payload_bytes += int(payload.numel())
        self.report.kv_bytes += kv
        self.report.canary_bytes += canary
        if ack.status == Status.OK:
            entry["status"] = "sent"
        else:
            self.report.fail(state.rid, f"decode dropped it: {Status(ack.status).name}")
