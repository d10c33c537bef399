"""What both roles share: the per-role report, the HELLO handshake, per-slot byte accounting."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvcanary_schema import Group

from .errors import TransferProtocolError
from .layout import TransferLayout
from .transport import Channel, Message, MsgKind


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
        self.error = {"type": type(err).__name__, "message": str(err), "detail": getattr(err, "detail", "")}

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
    peer = channel.recv(MsgKind.HELLO, step="HELLO", limit=channel.setup_timeout_s)
    if not first:
        channel.send(mine)
    if peer.digest != layout.digest:
        raise channel.error(TransferProtocolError, "HELLO",
                            f"transfer layouts differ: peer digest {peer.digest:#x}, mine {layout.digest:#x}")
