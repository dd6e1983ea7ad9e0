"""Typed answers to delta and update frames, and their wire form.

A receiver answers every delta or update with a `Reply`: a `ReplyStatus` saying what happened to the
frame (so senders branch on the status, never on the text) and the reason users read in
`events.jsonl` and `status` ("accepted: fragment 2 ...", "stale anchor: ..."). The reason starts with a
fixed tag (`Reply.tag`), e.g. the rejection reason a counter is kept under.

Wire form: one status byte (the index in `ReplyStatus`' declaration order, which never changes), then
the reason in UTF-8, at most `MAX_REASON_BYTES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from p2p_diloco.errors import DecodeError

MAX_REASON_BYTES = 4096
# A local reply: the receiver's address refused the connection (its process is gone, not merely slow).
PEER_DOWN = "peer down"


class ReplyStatus(StrEnum):
    ACCEPTED = "accepted"  # a delta is in a round (opened, added or replacing the sender's last one)
    APPLIED = "applied"  # an update was applied to the replica
    REFUSED = "refused"  # the frame was looked at and refused; `tag` says why
    TRANSIENT = "transient"  # the receiver (or the link) could not take it now: busy, starting, unreachable


_STATUS_CODES = list(ReplyStatus)


@dataclass(frozen=True)
class Reply:
    status: ReplyStatus
    reason: str

    @property
    def tag(self) -> str:
        """The fixed tag the reason starts with ("stale anchor: v3 ..." -> "stale anchor")."""
        return self.reason.split(":", 1)[0].split(" (")[0].strip()

    @property
    def ok(self) -> bool:
        return self.status in (ReplyStatus.ACCEPTED, ReplyStatus.APPLIED)

    def __str__(self) -> str:
        return self.reason

    @classmethod
    def refused(cls, tag: str, detail: str = "") -> Reply:
        return cls(ReplyStatus.REFUSED, f"{tag}: {detail}" if detail else tag)

    @classmethod
    def transient(cls, tag: str, detail: str = "") -> Reply:
        return cls(ReplyStatus.TRANSIENT, f"{tag}: {detail}" if detail else tag)


def encode_reply(reply: Reply) -> bytes:
    reason = reply.reason.encode("utf-8")[:MAX_REASON_BYTES]
    return bytes([_STATUS_CODES.index(reply.status)]) + reason


def decode_reply(data: bytes) -> Reply:
    """Strict: an unknown status byte, an over-long or non-UTF-8 reason raises `DecodeError`."""
    if not data:
        raise DecodeError("bad reply", "empty reply")
    if data[0] >= len(_STATUS_CODES):
        raise DecodeError("bad reply", f"unknown reply status {data[0]}")
    if len(data) - 1 > MAX_REASON_BYTES:
        raise DecodeError("bad reply", f"reason of {len(data) - 1} bytes exceeds {MAX_REASON_BYTES}")
    try:
        reason = data[1:].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DecodeError("bad reply", f"reason is not UTF-8: {exc}") from exc
    return Reply(_STATUS_CODES[data[0]], reason)
