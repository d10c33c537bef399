"""Decode role: own slots per offered request, KV rows and canary records received into them, then decoding."""

from __future__ import annotations

import os
import time

import torch

from kvcanary.engine.scheduler import ReqState, Request

from .canary import CanaryBinding, engine_layout
from .engines import DecodeEngine, request_id
from .errors import TransferError
from .session import RoleReport, handshake
from .transport import Channel, Delivery, FaultName, FaultSpec, FaultSwitch, Message, MsgKind, Status, abort_status


class DecodeRole:
    """Receives transfers, installs them (relocated), decodes, and fails requests whose transfer is corrupt.

    The transferred prefix is verified by the request's first decode forward (HEAD/TAIL verify of [0, prefix_len)
    with token truth from this side's own knowledge of the prompt); a violation fails only that request.
    """

    def __init__(self, engine: DecodeEngine, canary: CanaryBinding | None, channel: Channel, fault: FaultSpec,
                 requests: list[Request]) -> None:
        self.engine, self.canary, self.channel, self.fault = engine, canary, channel, fault
        self.layout = engine_layout(engine, canary)
        self.switch = FaultSwitch(fault, self.layout)
        self.known = {r.rid: r for r in requests}
        self.report = RoleReport("decode")
        self._pending: dict[int, tuple[ReqState, torch.Tensor, torch.Tensor]] = {}

    def run(self) -> RoleReport:
        """Serve OFFERs until BYE (or a fatal transfer error), then finish every installed request."""
        t0 = time.perf_counter()
        try:
            handshake(self.channel, self.layout, first=False)
            index = 0
            while True:
                msg = self.channel.recv(MsgKind.OFFER, MsgKind.BYE, idle=True,  # prefill computes in between
                                        step="wait for the next OFFER")
                if msg.kind == MsgKind.BYE:
                    self.channel.send(Message(MsgKind.BYE), step="answer BYE")
                    break
                self._receive(index, msg)
                index += 1
            for d in self.switch.flush():
                self._install(d)
        except TransferError as err:
            self.report.set_error(err)
            for state, _, _ in self._pending.values():
                self.report.fail(state.rid, f"transfer stopped: {type(err).__name__}")
                self.engine.drop(state)
            self._pending.clear()
            self.channel.abort(abort_status(err))
        while self.engine.step():
            self._poll(final=False)
        self._poll(final=True)
        self.report.faults_fired = self.switch.fired
        self.report.outputs = self.engine.outputs()
        for rid in self.report.outputs:
            if self.report.requests.get(rid, {}).get("status") == "installed":
                self.report.requests[rid]["status"] = "ok"
        self.report.seconds = time.perf_counter() - t0
        return self.report

    def _validate(self, msg: Message) -> tuple[Request | None, Status]:
        req = self.known.get(request_id(msg.req_key))
        vocab = self.engine.models.target.config.vocab_size
        if req is None or req.rid in self.report.requests or msg.body != req.prompt or \
                msg.prefix_len != len(req.prompt) or msg.full_rows != msg.prefix_len or \
                msg.digest != self.layout.digest or not 0 <= msg.first_token < vocab:
            return req, Status.BAD_META
        window = self.engine.models.target.config.sliding_window
        if not 0 <= msg.swa_rows <= (min(window, msg.full_rows) if self.engine.swa is not None else 0):
            return req, Status.BAD_META
        if msg.payload_bytes != self.layout.payload_bytes(msg.full_rows, msg.swa_rows):
            return req, Status.BAD_LENGTH
        return req, Status.OK

    def _receive(self, index: int, msg: Message) -> None:
        rid = request_id(msg.req_key)
        if self.fault.hits(FaultName.KILL_DECODE, index):
            os._exit(3)  # the fault: this process dies after the OFFER, before answering
        if self.fault.hits(FaultName.STALL_DECODE, index):
            # the fault: alive but silent past the peer's wait for the GRANT (ends early once the peer gives up)
            self.channel.stall(self.channel.idle_timeout_s + self.channel.timeout_s)
        req, status = self._validate(msg)
        reservation = None
        if req is not None and status == Status.OK:
            reservation = self.engine.reserve(req, msg.first_token, msg.full_rows, msg.swa_rows)
            while reservation is None and self.engine.scheduler.running:
                self._step()
                reservation = self.engine.reserve(req, msg.first_token, msg.full_rows, msg.swa_rows)
            status = Status.OK if reservation is not None else Status.NO_CAPACITY
        if reservation is None:
            self.channel.send(Message(MsgKind.REJECT, req_key=msg.req_key, status=int(status)),
                              step=f"send the REJECT of {rid}")
            self.report.fail(rid, "rejected", why=Status(status).name, index=index)
            return
        self._pending[index] = reservation
        self.report.requests[rid] = {"status": "receiving", "index": index, "prefix_len": msg.prefix_len,
                                     "swa_rows": msg.swa_rows}
        self.channel.send(Message(MsgKind.GRANT, req_key=msg.req_key), step=f"send the GRANT of {rid}")
        payload = self.channel.recv_payload(msg.payload_bytes, self.layout.device, step=f"receive the payload of {rid}")
        self.channel.send(Message(MsgKind.ACK, req_key=msg.req_key, status=int(Status.OK)),
                          step=f"send the ACK of {rid}")
        self.report.transfers += 1
        self.report.payload_bytes += msg.payload_bytes
        kv, canary = self.layout.split_bytes(msg.full_rows, msg.swa_rows)
        self.report.kv_bytes += kv
        self.report.canary_bytes += canary
        for d in self.switch.deliver(Delivery(index, msg, payload)):
            self._install(d)
        self._step()

    def _install(self, d: Delivery) -> None:
        state, full, swa = self._pending.pop(d.index)
        self.layout.scatter(d.payload, full, swa, d.missing)
        self.engine.activate(state)
        self.report.requests[state.rid]["status"] = "installed"

    def _step(self) -> None:
        self.engine.step()
        self._poll(final=False)

    def _poll(self, final: bool) -> None:
        if self.canary is None:
            return
        for v in self.canary.poll(final=final):
            row = v.to_dict()
            self.report.violations.append(row)
            rid = row.get("request_id")
            if rid is not None:
                self.report.fail(str(rid), "canary", first_violation=row)
                self.engine.abort(str(rid))
