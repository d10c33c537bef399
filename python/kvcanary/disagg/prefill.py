"""Prefill role: compute each prompt's KV, offer it to the decode role, send KV rows and canary records on GRANT."""

from __future__ import annotations

import os
import time

from kvcanary.engine.scheduler import ReqState, Request

from .canary import CanaryBinding, engine_layout
from .engines import PrefillEngine, request_key
from .errors import TransferError, TransferRejectedError
from .session import RoleReport, handshake, per_row
from .transport import Channel, FaultName, FaultSpec, Message, MsgKind, Status, abort_status


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
            self.channel.recv(MsgKind.BYE, step="wait for the BYE answer")
        except TransferError as err:
            self.report.set_error(err)
            for rid, entry in self.report.requests.items():
                if entry.get("status") == "pending":
                    self.report.fail(rid, f"transfer stopped: {type(err).__name__}")
            self.channel.abort(abort_status(err))
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
        self.channel.send(offer, corrupt_checksum=self.fault.hits(FaultName.BAD_HEADER, index),
                          step=f"send the OFFER of {state.rid}")
        reply = self.channel.recv(MsgKind.GRANT, MsgKind.REJECT, idle=True,  # decode may first make room
                                  step=f"wait for the GRANT of {state.rid}")
        entry = self.report.requests[state.rid]
        entry.update(index=index, first_token=state.tokens[-1], prefix_len=n, swa_rows=nswa)
        if reply.kind == MsgKind.REJECT:
            err = TransferRejectedError(offer.req_key, reply.status, Status(reply.status).name)
            self.report.fail(state.rid, "rejected", error={"type": type(err).__name__, "message": str(err)})
            return
        if self.fault.hits(FaultName.KILL_PREFILL, index):
            os._exit(3)  # the fault: this process dies between GRANT and payload
        self.channel.send_payload(payload, step=f"send the payload of {state.rid}")
        ack = self.channel.recv(MsgKind.ACK, step=f"wait for the ACK of {state.rid}")
        kv, canary = self.layout.split_bytes(n, nswa)
        self.report.transfers += 1
        self.report.payload_bytes += int(payload.numel())
        self.report.kv_bytes += kv
        self.report.canary_bytes += canary
        if ack.status == Status.OK:
            entry["status"] = "sent"
        else:
            self.report.fail(state.rid, f"decode dropped it: {Status(ack.status).name}")
