"""Point-to-point transfer channel over torch.distributed: checksummed headers, sized payloads, timeouts, faults."""

from __future__ import annotations

import enum
import queue
import random
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from kvcanary_schema import Stage

from kvcanary.errors import CanaryInputError

from .errors import PeerLostError, TransferError, TransferProtocolError, TransferTimeoutError
from .layout import TransferLayout

MAGIC = int.from_bytes(b"KVCDSAG", "little")
PROTOCOL_VERSION = 2  # 2: BYE is answered with BYE, so no receive is left posted at a clean end
MAX_BODY_WORDS = 1 << 20
POLL_S = 0.001  # how often a CUDA payload wait looks at the NCCL work and the control reader


class Hdr(enum.IntEnum):
    """Words of a control-message header (int64)."""

    MAGIC = 0
    VERSION = enum.auto()
    KIND = enum.auto()
    SEQ = enum.auto()
    REQ_KEY = enum.auto()
    PREFIX_LEN = enum.auto()
    FIRST_TOKEN = enum.auto()
    FULL_ROWS = enum.auto()
    SWA_ROWS = enum.auto()
    PAYLOAD_BYTES = enum.auto()
    STATUS = enum.auto()
    DIGEST = enum.auto()
    BODY_LEN = enum.auto()
    CHECKSUM = enum.auto()


HEADER_WORDS = len(Hdr)


class MsgKind(enum.IntEnum):
    """Control messages. Prefill -> decode: HELLO, OFFER, BYE; decode -> prefill: HELLO, GRANT, REJECT, ACK."""

    HELLO = 1
    OFFER = 2  # a request's metadata (body: prompt tokens); the payload follows only after a GRANT
    GRANT = 3  # decode allocated slots: send the payload
    REJECT = 4  # decode refuses this request (STATUS says why); no payload follows
    ACK = 5  # payload received and installed (STATUS = OK) or dropped (STATUS says why)
    BYE = 6  # no more requests (prefill); answered with BYE (decode)
    ABORT = 7  # the sender hit a fatal error and is shutting down (STATUS says why)


class Status(enum.IntEnum):
    """Why a request's transfer failed (STATUS word)."""

    OK = 0
    BAD_LENGTH = 1  # declared payload size disagrees with the layout and row counts
    NO_CAPACITY = 2  # the decode side cannot hold the request
    BAD_META = 3  # unknown request, or metadata disagrees with the decode side's own knowledge
    PROTOCOL = 4  # malformed message (fatal)
    PEER_ERROR = 5  # the peer failed (fatal)
    TIMEOUT = 6  # the sender timed out waiting for this side (fatal)


@dataclass(frozen=True)
class Message:
    """A decoded control message."""

    kind: MsgKind
    seq: int = 0
    req_key: int = 0
    prefix_len: int = 0
    first_token: int = 0
    full_rows: int = 0
    swa_rows: int = 0
    payload_bytes: int = 0
    status: int = 0
    digest: int = 0
    body: tuple[int, ...] = ()


def _checksum(words: torch.Tensor, body: torch.Tensor) -> int:
    crc = zlib.crc32(words[: int(Hdr.CHECKSUM)].numpy().tobytes())
    return zlib.crc32(body.numpy().tobytes(), crc)


def encode(msg: Message, *, corrupt_checksum: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Header and body tensors (CPU int64) of a message."""
    h = torch.zeros(HEADER_WORDS, dtype=torch.int64)
    for word, value in ((Hdr.MAGIC, MAGIC), (Hdr.VERSION, PROTOCOL_VERSION), (Hdr.KIND, int(msg.kind)),
                        (Hdr.SEQ, msg.seq), (Hdr.REQ_KEY, msg.req_key), (Hdr.PREFIX_LEN, msg.prefix_len),
                        (Hdr.FIRST_TOKEN, msg.first_token), (Hdr.FULL_ROWS, msg.full_rows),
                        (Hdr.SWA_ROWS, msg.swa_rows), (Hdr.PAYLOAD_BYTES, msg.payload_bytes),
                        (Hdr.STATUS, msg.status), (Hdr.DIGEST, msg.digest), (Hdr.BODY_LEN, len(msg.body))):
        h[word] = value
    body = torch.tensor(msg.body, dtype=torch.int64)
    h[Hdr.CHECKSUM] = _checksum(h, body) ^ (1 if corrupt_checksum else 0)
    return h, body


def decode_header(h: torch.Tensor) -> int:
    """Validate a header's magic, version, kind and body length; return the body length."""
    if int(h[Hdr.MAGIC]) != MAGIC or int(h[Hdr.VERSION]) != PROTOCOL_VERSION:
        raise TransferProtocolError(f"bad magic/version {int(h[Hdr.MAGIC]):#x}/{int(h[Hdr.VERSION])}")
    if int(h[Hdr.KIND]) not in MsgKind._value2member_map_:
        raise TransferProtocolError(f"unknown message kind {int(h[Hdr.KIND])}")
    n = int(h[Hdr.BODY_LEN])
    if not 0 <= n <= MAX_BODY_WORDS:
        raise TransferProtocolError(f"body length {n} outside [0, {MAX_BODY_WORDS}]")
    return n


def decode(h: torch.Tensor, body: torch.Tensor) -> Message:
    """Check the checksum and build the message."""
    if _checksum(h, body) != int(h[Hdr.CHECKSUM]):
        raise TransferProtocolError(f"header checksum mismatch (kind {int(h[Hdr.KIND])}, seq {int(h[Hdr.SEQ])})")
    return Message(MsgKind(int(h[Hdr.KIND])), int(h[Hdr.SEQ]), int(h[Hdr.REQ_KEY]), int(h[Hdr.PREFIX_LEN]),
                   int(h[Hdr.FIRST_TOKEN]), int(h[Hdr.FULL_ROWS]), int(h[Hdr.SWA_ROWS]),
                   int(h[Hdr.PAYLOAD_BYTES]), int(h[Hdr.STATUS]), int(h[Hdr.DIGEST]), tuple(body.tolist()))


LOST_WORDS = ("connection", "reset", "closed", "broken pipe", "read error", "write error", "eof", "peer", "remote",
              "exited", "abort")
FOREVER = timedelta(days=365)  # the control reader's receive: a dead peer ends it at once, a timeout never should


def transport_detail(err: BaseException) -> str:
    """The first line of what the transport said (kept for the log, never put into a message)."""
    return str(err).splitlines()[0][:300] if str(err) else type(err).__name__


def _classify(err: BaseException, peer_role: str) -> tuple[type[TransferError], str]:
    """A transport exception -> the typed error and its cause in plain words."""
    text = str(err).lower()
    if "timed out" in text or "timeout" in text:
        return TransferTimeoutError, "the transport timed out"
    if any(s in text for s in LOST_WORDS):
        return PeerLostError, f"{peer_role} is gone"
    return TransferError, "the transport failed"


@dataclass(frozen=True)
class PeerEnd:
    """Why the control reader stopped: the peer said BYE or ABORT, the connection died, or a message was bad."""

    kind: str  # "bye" / "abort" / "lost" / "protocol"
    cause: str
    detail: str = ""
    status: int = 0


class Channel:
    """Control messages (CPU, gloo) and payloads (the data group: gloo on CPU, NCCL on GPUs) to one peer.

    A reader thread keeps one control receive posted at all times, so a dead peer is seen at once (gloo fails
    the pending receive when the connection closes) while this side computes, sends, or waits for a payload.
    Every wait is bounded by ``timeout_s`` (``idle_timeout_s`` for a message the peer may first have to compute:
    the next OFFER, a GRANT). Control waits time out on the inbox, never inside gloo, so a timeout leaves the
    control group usable for the ABORT that follows. Payload waits on CUDA poll the NCCL work (NCCL has no
    per-operation timeout and never notices a dead peer) and the control reader together; nothing is made to wait
    on a payload that has not completed, and one given up on has its communicator aborted (its kernel would block
    every later kernel load on the GPU), so a lost peer cannot block later work, a stream sync or teardown.
    Errors read ``"<role>: <step>: <cause>"``; transport text goes to ``detail``.
    """

    def __init__(self, peer: int, control_group: Any, data_group: Any, timeout_s: float,
                 idle_timeout_s: float | None = None, role: str = "prefill", peer_role: str = "decode",
                 setup_timeout_s: float | None = None) -> None:
        idle = 6 * timeout_s if idle_timeout_s is None else idle_timeout_s
        if timeout_s <= 0 or idle < timeout_s:
            raise CanaryInputError(f"need 0 < timeout_s <= idle_timeout_s, got {timeout_s}, {idle}")
        self.peer, self.control, self.data, self.timeout_s = peer, control_group, data_group, timeout_s
        self.idle_timeout_s, self.role, self.peer_role = idle, role, peer_role
        self.setup_timeout_s = max(idle, setup_timeout_s or 0.0)  # HELLO: the peer may still be building its engine
        self._seq_out = 0
        self._seq_in = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self._inbox: queue.Queue[Message | None] = queue.Queue()
        self.end: PeerEnd | None = None  # set by the reader when it stops
        self._ended = threading.Event()
        self._reader = threading.Thread(target=self._read_loop, name=f"{role}-control-reader", daemon=True)
        self._reader.start()

    # ---- the control reader ----------------------------------------------------------------------------------

    def _read_loop(self) -> None:
        while True:
            try:
                msg = self._read_one()
            except TransferProtocolError as err:
                return self._stop(PeerEnd("protocol", str(err)))
            except Exception as err:  # gloo: connection closed / reset; anything else ends the channel as well
                return self._stop(PeerEnd("lost", f"{self.peer_role} is gone", transport_detail(err)))
            if msg.kind == MsgKind.BYE:
                return self._stop(PeerEnd("bye", f"{self.peer_role} said BYE"), msg)
            if msg.kind == MsgKind.ABORT:
                return self._stop(PeerEnd("abort", f"{self.peer_role} gave up ({_status_name(msg.status)})",
                                          status=msg.status), msg)
            self._inbox.put(msg)

    def _recv_control(self, t: torch.Tensor) -> None:
        work: Any = dist.irecv(t, self.peer, group=self.control)
        work.wait(FOREVER)

    def _read_one(self) -> Message:
        h = torch.zeros(HEADER_WORDS, dtype=torch.int64)
        self._recv_control(h)
        n = decode_header(h)
        body = torch.zeros(n, dtype=torch.int64)
        if n:
            self._recv_control(body)
        msg = decode(h, body)
        if msg.seq != self._seq_in:
            raise TransferProtocolError(f"message sequence {msg.seq}, expected {self._seq_in}")
        self._seq_in += 1
        return msg

    def _stop(self, end: PeerEnd, last: Message | None = None) -> None:
        self.end = end  # before the last message is visible: recv() of an ABORT reads it
        if last is not None:
            self._inbox.put(last)
        self._inbox.put(None)  # wakes a waiting recv(); every later recv() fails with ``end``
        self._ended.set()

    # ---- errors ----------------------------------------------------------------------------------------------

    def error(self, cls: type[TransferError], step: str, cause: str, detail: str = "") -> TransferError:
        """A typed error whose message names this role, the step and the cause (one line)."""
        return cls(f"{self.role}: {step}: {cause}", detail)

    def _end_error(self, step: str) -> TransferError:
        end = self.end
        if end is None or end.kind == "bye":
            return self.error(TransferProtocolError, step, f"{self.peer_role} already said BYE")
        if end.kind == "protocol" or (end.kind == "abort" and end.status == Status.PROTOCOL):
            return self.error(TransferProtocolError, step, end.cause, end.detail)
        return self.error(PeerLostError, step, end.cause, end.detail)

    def _typed(self, err: RuntimeError, step: str) -> TransferError:
        cls, cause = _classify(err, self.peer_role)
        if cls is TransferTimeoutError:
            cause = f"no progress within {self.timeout_s:g} s"
        return self.error(cls, step, cause, transport_detail(err))

    def _start(self, start: Callable[[], Any], step: str) -> Any:
        """Post an operation (gloo refuses at once when the connection is already closed)."""
        try:
            return start()
        except RuntimeError as err:
            raise self._typed(err, step) from err

    def _wait(self, start: Callable[[], Any], step: str) -> None:
        """Post a gloo operation and wait for it (at most ``timeout_s``); a failure becomes a typed error."""
        work = self._start(start, step)
        try:
            work.wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as err:
            raise self._typed(err, step) from err

    # ---- control messages ------------------------------------------------------------------------------------

    def send(self, msg: Message, *, corrupt_checksum: bool = False, step: str | None = None) -> None:
        """Send a control message (the sequence number is filled in); refuse when the peer is gone or gave up."""
        step = step or f"send {msg.kind.name}"
        if self.end is not None and self.end.kind in ("lost", "abort") and msg.kind != MsgKind.ABORT:
            raise self._end_error(step)
        h, body = encode(replace(msg, seq=self._seq_out), corrupt_checksum=corrupt_checksum)
        self._seq_out += 1
        self._wait(lambda: dist.isend(h, self.peer, group=self.control), step)
        if body.numel():
            self._wait(lambda: dist.isend(body, self.peer, group=self.control), step)

    def recv(self, *kinds: MsgKind, idle: bool = False, step: str | None = None, limit: float | None = None) -> Message:
        """Receive the next control message; raise unless it is one of ``kinds`` (ABORT always raises).

        ``idle``: the peer may have work to do before it answers (wait up to ``idle_timeout_s``); ``limit``: another
        wait (seconds).
        """
        step = step or f"receive {' or '.join(k.name for k in kinds) or 'a message'}"
        limit = limit if limit is not None else (self.idle_timeout_s if idle else self.timeout_s)
        try:
            msg = self._inbox.get(timeout=limit)
        except queue.Empty:
            raise self.error(TransferTimeoutError, step,
                             f"no message from {self.peer_role} within {limit:g} s") from None
        if msg is None:
            self._inbox.put(None)  # the reader has stopped: every later recv() fails the same way
            raise self._end_error(step)
        if msg.kind == MsgKind.ABORT:
            raise self._end_error(step)
        if kinds and msg.kind not in kinds:
            raise self.error(TransferProtocolError, step, f"got {msg.kind.name}")
        return msg

    def stall(self, seconds: float) -> None:
        """The stall fault: stay silent for up to ``seconds`` (returns early when the peer gives up or dies)."""
        self._ended.wait(seconds)

    # ---- payloads --------------------------------------------------------------------------------------------

    def _wait_payload(self, start: Callable[[], Any], cuda: bool, step: str) -> None:
        if not cuda:  # gloo fails the operation itself when the connection closes
            self._wait(start, step)
            return
        work = self._start(start, step)
        deadline = time.monotonic() + self.timeout_s
        while not work.is_completed():  # an event query; NCCL itself would wait forever for a dead peer
            if self.end is not None and self.end.kind in ("lost", "abort", "protocol"):
                self._abandon_data()
                raise self._end_error(step)
            if time.monotonic() > deadline:
                self._abandon_data()
                raise self.error(TransferTimeoutError, step, f"not complete within {self.timeout_s:g} s")
            self._ended.wait(POLL_S)
        try:
            work.wait()  # complete: only orders the current stream after the transfer
        except RuntimeError as err:  # completed with an error (e.g. the watchdog aborted the communicator)
            raise self._typed(err, step) from err

    def _abandon_data(self) -> None:
        """Abort the data group's NCCL communicator under a payload that will never complete.

        Its kernel would spin on this GPU for good, and with CUDA's lazy module loading (the default) the first launch
        of any kernel not yet loaded in this process synchronizes the context, so it would wait on that kernel
        forever: the role hung at its next new kernel (the canary's slot invalidation, the reference run's first
        matmul; 2x H100, 2026-11-26). The abort ends the kernel; the data group is unusable afterwards, the control
        group (gloo) is untouched. Bounded: an abort that does not return within ``timeout_s`` is left behind.
        """
        aborter = threading.Thread(target=self.data.abort, name=f"{self.role}-data-abort", daemon=True)
        aborter.start()
        aborter.join(self.timeout_s)

    def send_payload(self, buf: torch.Tensor, step: str = "send the payload") -> None:
        """Send a payload whose size the peer learned from the OFFER."""
        self._wait_payload(lambda: dist.isend(buf, self.peer, group=self.data), buf.is_cuda, step)
        self.bytes_sent += int(buf.numel())

    def recv_payload(self, nbytes: int, device: torch.device, step: str = "receive the payload") -> torch.Tensor:
        """Receive a payload of exactly ``nbytes`` bytes."""
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._wait_payload(lambda: dist.irecv(buf, self.peer, group=self.data), buf.is_cuda, step)
        self.bytes_received += nbytes
        return buf

    def abort(self, status: Status) -> None:
        """Best effort: tell the peer that this side is shutting down after a fatal error."""
        if self.end is not None and self.end.kind in ("lost", "abort"):
            return
        try:
            self.send(Message(MsgKind.ABORT, status=int(status)))
        except TransferError:
            pass


def _status_name(status: int) -> str:
    return Status(status).name if status in Status._value2member_map_ else f"status {status}"


def abort_status(err: TransferError) -> Status:
    """The STATUS an ABORT carries after ``err``."""
    if isinstance(err, TransferProtocolError):
        return Status.PROTOCOL
    return Status.TIMEOUT if isinstance(err, TransferTimeoutError) else Status.PEER_ERROR


# ---- seeded transfer faults -----------------------------------------------------------------------------------

class FaultName(enum.StrEnum):
    """Transfer faults. In-transit faults change what the decode side installs; the prefill side is untouched."""

    NONE = "none"
    CORRUPT = "corrupt"  # one byte of one KV row flipped in transit -> fingerprint
    TRUNCATE_LAYERS = "truncate_layers"  # the last layers' K/V never arrive -> fingerprint (coverage 'all')
    TRUNCATE_TAIL = "truncate_tail"  # the TAIL record buffers never arrive -> TAIL chain/position
    SWAP = "swap"  # two requests' payloads (KV and records) swapped -> token truth
    STALE = "stale"  # an earlier request's payload delivered again in place of this one's -> token truth
    BAD_LENGTH = "bad_length"  # the OFFER declares a wrong payload size -> REJECT, request failed, others go on
    BAD_HEADER = "bad_header"  # a corrupted OFFER header -> protocol error on both sides
    STALL_DECODE = "stall_decode"  # the decode process stops answering -> TransferTimeoutError on the prefill side
    KILL_DECODE = "kill_decode"  # the decode process dies mid-transfer -> PeerLostError on the prefill side
    KILL_PREFILL = "kill_prefill"  # the prefill process dies mid-transfer -> PeerLostError on the decode side


IN_TRANSIT = frozenset({FaultName.CORRUPT, FaultName.TRUNCATE_LAYERS, FaultName.TRUNCATE_TAIL, FaultName.SWAP,
                        FaultName.STALE})


@dataclass(frozen=True)
class FaultSpec:
    """Which fault hits which transfer (0-based order); ``layers``: how many trailing layers a truncation drops."""

    name: FaultName = FaultName.NONE
    target: int = 1
    seed: int = 0
    layers: int = 1

    def __post_init__(self) -> None:
        if self.target < 0 or self.layers < 1:
            raise CanaryInputError("fault target must be >= 0 and layers >= 1")
        if self.name == FaultName.STALE and self.target < 1:
            raise CanaryInputError("a stale transfer needs an earlier one: target >= 1")

    def hits(self, name: FaultName, index: int) -> bool:
        """Whether fault ``name`` fires at transfer ``index``."""
        return self.name == name and index == self.target

    def victims(self) -> tuple[int, ...]:
        """Transfer indices whose requests the fault corrupts."""
        if self.name == FaultName.SWAP:
            return (self.target, self.target + 1)
        return () if self.name == FaultName.NONE else (self.target,)


@dataclass
class Delivery:
    """One received transfer on its way to installation: metadata, payload, items that never arrived."""

    index: int
    msg: Message
    payload: torch.Tensor
    missing: frozenset[int] = frozenset()


@dataclass
class FaultSwitch:
    """Applies the in-transit fault of a FaultSpec to received transfers (seeded; logs what it did)."""

    spec: FaultSpec
    layout: TransferLayout
    fired: list[dict[str, object]] = field(default_factory=list)
    _held: Delivery | None = None
    _previous: Delivery | None = None

    def __post_init__(self) -> None:
        self._rng = random.Random(self.spec.seed)

    def deliver(self, d: Delivery) -> list[Delivery]:
        """Transfers ready to install after ``d`` arrived (a swap holds the first of its pair back)."""
        spec, out = self.spec, [d]
        if spec.hits(FaultName.CORRUPT, d.index):
            self._corrupt(d)
        elif spec.hits(FaultName.TRUNCATE_LAYERS, d.index):
            last = max(item.layer for item in self.layout.items)
            d.missing = frozenset(i for i, item in enumerate(self.layout.items)
                                  if not item.canary and item.layer > last - spec.layers)
            self._log(d, "missing", sorted(self.layout.items[i].name for i in d.missing))
        elif spec.hits(FaultName.TRUNCATE_TAIL, d.index):
            d.missing = frozenset(i for i, item in enumerate(self.layout.items) if item.stage == Stage.TAIL)
            self._log(d, "missing", sorted(self.layout.items[i].name for i in d.missing))
        elif spec.hits(FaultName.STALE, d.index) and self._previous is not None:
            self._overlay(d, self._previous)
            self._log(d, "stale_from", self._previous.msg.req_key)
        elif spec.hits(FaultName.SWAP, d.index):
            self._held, out = d, []
        elif self._held is not None and d.index == self._held.index + 1:
            first, self._held = self._held, None
            a, b = first.payload.clone(), d.payload.clone()
            self._overlay(first, Delivery(d.index, d.msg, b))
            self._overlay(d, Delivery(first.index, first.msg, a))
            self._log(first, "swapped_with", d.msg.req_key)
            out = [first, d]
        self._previous = Delivery(d.index, d.msg, d.payload.clone())
        return out

    def flush(self) -> list[Delivery]:
        """A swap partner still held back when no further transfer came."""
        held, self._held = self._held, None
        return [held] if held is not None else []

    def _log(self, d: Delivery, key: str, value: object) -> None:
        self.fired.append({"fault": self.spec.name.value, "index": d.index, "req_key": d.msg.req_key, key: value})

    def _corrupt(self, d: Delivery) -> None:
        full, swa = d.msg.full_rows, d.msg.swa_rows
        kv = [i for i, item in enumerate(self.layout.items)
              if not item.canary and self.layout.rows_of(item, full, swa) > 0]
        index = kv[self._rng.randrange(len(kv))]
        rows = self.layout.view(d.payload, index, full, swa)
        row, byte = self._rng.randrange(rows.shape[0]), self._rng.randrange(rows.shape[1])
        rows[row, byte] ^= 0xFF
        self._log(d, "flipped", {"item": self.layout.items[index].name, "row": row, "byte": byte})

    def _overlay(self, dst: Delivery, src: Delivery) -> None:
        """Copy ``src``'s rows over ``dst``'s, item by item (as many rows as both have)."""
        for i in range(len(self.layout.items)):
            a = self.layout.view(dst.payload, i, dst.msg.full_rows, dst.msg.swa_rows)
            b = self.layout.view(src.payload, i, src.msg.full_rows, src.msg.swa_rows)
            n = min(a.shape[0], b.shape[0])
            a[:n] = b[:n]
