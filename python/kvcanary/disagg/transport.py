"""Point-to-point transfer channel over torch.distributed: checksummed headers, sized payloads, timeouts, faults."""

from __future__ import annotations

import enum
import random
import zlib
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
PROTOCOL_VERSION = 1
MAX_BODY_WORDS = 1 << 20


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
    BYE = 6  # no more requests
    ABORT = 7  # the sender hit a fatal error and is shutting down (STATUS says why)


class Status(enum.IntEnum):
    """Why a request's transfer failed (STATUS word)."""

    OK = 0
    BAD_LENGTH = 1  # declared payload size disagrees with the layout and row counts
    NO_CAPACITY = 2  # the decode side cannot hold the request
    BAD_META = 3  # unknown request, or metadata disagrees with the decode side's own knowledge
    PROTOCOL = 4  # malformed message (fatal)
    PEER_ERROR = 5  # the peer failed (fatal)


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


def _classify(err: BaseException, what: str, timeout_s: float) -> TransferError:
    text = str(err).lower()
    if "timed out" in text or "timeout" in text:
        return TransferTimeoutError(f"{what}: no answer from the peer within {timeout_s:g} s")
    if any(s in text for s in ("connection", "reset", "closed", "broken pipe", "read error", "write error", "eof",
                               "peer", "remote", "exited", "abort")):
        return PeerLostError(f"{what}: the peer is gone ({str(err).splitlines()[0][:200]})")
    return TransferError(f"{what}: {str(err).splitlines()[0][:200]}")


class Channel:
    """Control messages (CPU, gloo) and payloads (the data group: gloo on CPU, NCCL on GPUs) to one peer.

    Every blocking operation waits at most ``timeout_s`` (``idle_timeout_s`` for a message the peer may first have
    to compute: the next OFFER, a GRANT) and raises PeerLostError / TransferTimeoutError / TransferProtocolError
    instead of hanging. Sequence numbers per direction catch lost or repeated messages.
    """

    def __init__(self, peer: int, control_group: Any, data_group: Any, timeout_s: float,
                 idle_timeout_s: float | None = None) -> None:
        idle = 6 * timeout_s if idle_timeout_s is None else idle_timeout_s
        if timeout_s <= 0 or idle < timeout_s:
            raise CanaryInputError(f"need 0 < timeout_s <= idle_timeout_s, got {timeout_s}, {idle}")
        self.peer, self.control, self.data, self.timeout_s = peer, control_group, data_group, timeout_s
        self.idle_timeout_s = idle
        self._seq_out = 0
        self._seq_in = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.peer_aborted = False

    def _wait(self, start: Any, what: str, idle: bool = False) -> None:
        limit = self.idle_timeout_s if idle else self.timeout_s
        try:
            work = start()
            work.wait(timeout=timedelta(seconds=limit))
        except TransferError:
            raise
        except RuntimeError as err:
            raise _classify(err, what, limit) from err

    def send(self, msg: Message, *, corrupt_checksum: bool = False) -> None:
        """Send a control message (the sequence number is filled in)."""
        h, body = encode(replace(msg, seq=self._seq_out), corrupt_checksum=corrupt_checksum)
        self._seq_out += 1
        self._wait(lambda: dist.isend(h, self.peer, group=self.control), f"send {msg.kind.name}")
        if body.numel():
            self._wait(lambda: dist.isend(body, self.peer, group=self.control), f"send {msg.kind.name} body")

    def recv(self, *kinds: MsgKind, idle: bool = False) -> Message:
        """Receive the next control message; raise unless it is one of ``kinds`` (ABORT always raises).

        ``idle``: the peer may have work to do before it answers (wait up to ``idle_timeout_s``).
        """
        h = torch.zeros(HEADER_WORDS, dtype=torch.int64)
        self._wait(lambda: dist.irecv(h, self.peer, group=self.control), "receive a control message", idle)
        n = decode_header(h)
        body = torch.zeros(n, dtype=torch.int64)
        if n:
            self._wait(lambda: dist.irecv(body, self.peer, group=self.control), "receive a message body")
        msg = decode(h, body)
        if msg.seq != self._seq_in:
            raise TransferProtocolError(f"message sequence {msg.seq}, expected {self._seq_in}")
        self._seq_in += 1
        if msg.kind == MsgKind.ABORT:
            self.peer_aborted = True
            cls = TransferProtocolError if msg.status == Status.PROTOCOL else PeerLostError
            raise cls(f"the peer aborted after a fatal error: {Status(msg.status).name}")
        if kinds and msg.kind not in kinds:
            raise TransferProtocolError(f"got {msg.kind.name}, expected {' or '.join(k.name for k in kinds)}")
        return msg

    def send_payload(self, buf: torch.Tensor) -> None:
        """Send a payload whose size the peer learned from the OFFER."""
        self._wait(lambda: dist.isend(buf, self.peer, group=self.data), "send a payload")
        self.bytes_sent += int(buf.numel())

    def recv_payload(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """Receive a payload of exactly ``nbytes`` bytes."""
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._wait(lambda: dist.irecv(buf, self.peer, group=self.data), "receive a payload")
        self.bytes_received += nbytes
        return buf

    def abort(self, status: Status) -> None:
        """Best effort: tell the peer that this side is shutting down after a fatal error."""
        if self.peer_aborted:
            return
        try:
            self.send(Message(MsgKind.ABORT, status=int(status)))
        except TransferError:
            pass


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
