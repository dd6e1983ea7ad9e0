"""Typed answers to delta and update frames, and their wire form.

A receiver answers every delta or update with a `Reply`: a `ReplyStatus` saying what happened to the
frame, a `tag` saying why (a member of the deciding rule's `StrEnum`, e.g. `RoundTag.STALE_ANCHOR`; the
rejection counters are kept under it), the `detail` people read in `events.jsonl` and `status`, and
`retry_after`, the seconds a refused sender should hold its next frame (a cool-down's remainder; 0: none).
Senders branch on `status`, `tag` and `retry_after`, never on text; `reason` ("<tag>: <detail>") is only
shown.

Wire form: one status byte (the index in `ReplyStatus`' declaration order, which never changes), one byte
with the tag's length in UTF-8, `retry_after` as a big-endian float64, the tag, then the detail in UTF-8;
all of it at most `MAX_REPLY_BYTES`.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from enum import StrEnum

from p2p_diloco.errors import DecodeError
from p2p_diloco.protocol.decisions import Decision, reason_text

MAX_REASON_BYTES = 4096
MAX_TAG_BYTES = 255
_HEAD = struct.Struct(">BBd")  # status, tag length, retry_after
MAX_REPLY_BYTES = _HEAD.size + MAX_TAG_BYTES + MAX_REASON_BYTES


class LinkTag(StrEnum):
    """Why a frame got no answer from the receiver's peer (set on the sender's side)."""

    PEER_DOWN = "peer down"  # the receiver's address refused the connection (its process is gone, not slow)


class ReplyStatus(StrEnum):
    ACCEPTED = "accepted"  # a delta is in a round (opened, added or replacing the sender's last one)
    APPLIED = "applied"  # an update was applied to the replica
    REFUSED = "refused"  # the frame was looked at and refused; `tag` says why
    TRANSIENT = "transient"  # the receiver (or the link) could not take it now: busy, starting, unreachable


_STATUS_CODES = list(ReplyStatus)


@dataclass(frozen=True)
class Reply:
    status: ReplyStatus
    tag: str
    detail: str = ""
    retry_after: float = 0.0

    @property
    def reason(self) -> str:
        return reason_text(self.tag, self.detail)

    @property
    def ok(self) -> bool:
        return self.status in (ReplyStatus.ACCEPTED, ReplyStatus.APPLIED)

    def __str__(self) -> str:
        return self.reason

    @classmethod
    def refused(cls, tag: str, detail: str = "", retry_after: float = 0.0) -> Reply:
        return cls(ReplyStatus.REFUSED, tag, detail, retry_after)

    @classmethod
    def transient(cls, tag: str, detail: str = "") -> Reply:
        return cls(ReplyStatus.TRANSIENT, tag, detail)

    @classmethod
    def of(cls, status: ReplyStatus, decision: Decision) -> Reply:
        """A rule's decision as the answer with `status`."""
        return cls(status, decision.tag, decision.detail)


def encode_reply(reply: Reply) -> bytes:
    tag = str(reply.tag).encode("utf-8")[:MAX_TAG_BYTES]
    detail = reply.detail.encode("utf-8")[:MAX_REASON_BYTES]
    head = _HEAD.pack(_STATUS_CODES.index(reply.status), len(tag), float(reply.retry_after))
    return head + tag + detail


def decode_reply(data: bytes) -> Reply:
    """Strict: an unknown status byte, a short or over-long reply, non-UTF-8 text or a negative or
    non-finite `retry_after` raises `DecodeError`."""
    if len(data) < _HEAD.size:
        raise DecodeError(
            "bad reply", f"reply of {len(data)} bytes is shorter than its {_HEAD.size}-byte head"
        )
    if len(data) > MAX_REPLY_BYTES:
        raise DecodeError("bad reply", f"reply of {len(data)} bytes exceeds {MAX_REPLY_BYTES}")
    status, tag_length, retry_after = _HEAD.unpack_from(data)
    if status >= len(_STATUS_CODES):
        raise DecodeError("bad reply", f"unknown reply status {status}")
    if not (math.isfinite(retry_after) and retry_after >= 0):
        raise DecodeError("bad reply", f"retry_after {retry_after} is not a finite number >= 0")
    body = data[_HEAD.size :]
    if tag_length > len(body):
        raise DecodeError("bad reply", f"tag of {tag_length} bytes runs past the reply's {len(body)}")
    try:
        tag, detail = body[:tag_length].decode("utf-8"), body[tag_length:].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DecodeError("bad reply", f"reply text is not UTF-8: {exc}") from exc
    return Reply(_STATUS_CODES[status], tag, detail, retry_after)
