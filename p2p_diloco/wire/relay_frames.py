"""The wire form of relaying updates peer to peer (`swarm.relay`): an offer, and a relayed update.

A peer that checked and applied an update offers it onward with a small `Offer`: the update's identity
(`UpdateId`: fragment, versions, term, leader, checksum) and the hop it would arrive at. The receiver
answers with a typed `Reply` (`RelayTag.SEND`: it lacks the update and asks this peer for it; refused
`HAVE`, `ASKED` or `DROPPED` otherwise), and only then gets the update frame itself, wrapped with its
hop (`encode_relayed`). Both go over one transport op (`keys.OP_RELAY`); the first byte says which.

The identity is never trusted: the receiver checks the relayed record in full (signature, lease,
content, checksum) as it checks one pushed by its leader, and refuses a record that is not what was
offered (`RelayTag.MISMATCH`).

Offer: kind byte 1, hop (u8), fragment (u32), from_version (u64), term (u64), then the leader and the
checksum, each as a length byte and ASCII. Relayed update: kind byte 2, hop (u8), the update frame.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum, StrEnum

from p2p_diloco.errors import DecodeError
from p2p_diloco.protocol.messages import UpdateRecord

_OFFER = struct.Struct(">BBIQQ")  # kind, hop, fragment, from_version, term
_RELAYED = struct.Struct(">BB")  # kind, hop
MAX_TEXT_BYTES = 128  # a peer ID or a checksum
MAX_HOP = 255
MAX_OFFER_BYTES = _OFFER.size + 2 * (1 + MAX_TEXT_BYTES)
RELAY_HEAD_BYTES = _RELAYED.size  # what a relayed update frame adds to the update frame


class RelayKind(IntEnum):
    OFFER = 1
    UPDATE = 2


class RelayTag(StrEnum):
    """What a relay frame got (the reply's tag); offences are counted and drop the relayer."""

    SEND = "send it"  # the receiver lacks the offered update and asks the offerer for it
    HAVE = "have it"  # the receiver holds that version already
    ASKED = "asked another peer"  # the receiver waits for this update from another relayer
    DROPPED = "relayer dropped"  # this relayer sent garbage before: the receiver takes nothing from it
    UNASKED = "not asked for"  # a relayed update the receiver did not ask this peer for
    MISMATCH = "not what was offered"  # the relayed record is not the update that was offered
    BAD_FRAME = "bad relay frame"


@dataclass(frozen=True, order=True)
class UpdateId:
    """Which update an offer names. Claims only: the relayed record is checked against it."""

    fragment: int
    from_version: int
    term: int
    leader: str
    checksum: str

    @property
    def to_version(self) -> int:
        return self.from_version + 1

    @classmethod
    def of(cls, record: UpdateRecord) -> UpdateId:
        return cls(record.fragment, record.from_version, record.term, record.leader, record.checksum)

    def __str__(self) -> str:
        return f"fragment {self.fragment} v{self.to_version} (term {self.term})"


@dataclass(frozen=True)
class Offer:
    update: UpdateId
    hop: int  # the hop at which the update would reach the receiver (the leader's push is hop 1)


@dataclass(frozen=True)
class Relayed:
    hop: int
    frame: bytes  # a `wire.frames` update frame


def _text(value: str, what: str) -> bytes:
    data = value.encode("ascii", errors="replace")
    if len(data) > MAX_TEXT_BYTES:
        raise ValueError(f"{what} of {len(data)} bytes > {MAX_TEXT_BYTES}")
    return bytes([len(data)]) + data


def encode_offer(offer: Offer) -> bytes:
    u = offer.update
    head = _OFFER.pack(RelayKind.OFFER, min(offer.hop, MAX_HOP), u.fragment, u.from_version, u.term)
    return head + _text(u.leader, "leader") + _text(u.checksum, "checksum")


def encode_relayed(hop: int, frame: bytes) -> bytes:
    return _RELAYED.pack(RelayKind.UPDATE, min(hop, MAX_HOP)) + frame


def _read_text(data: bytes, at: int, what: str) -> tuple[str, int]:
    if at >= len(data):
        raise DecodeError(RelayTag.BAD_FRAME, f"offer ends before its {what}")
    n = data[at]
    text = data[at + 1 : at + 1 + n]
    if len(text) != n:
        raise DecodeError(RelayTag.BAD_FRAME, f"offer's {what} runs past its end")
    try:
        return text.decode("ascii"), at + 1 + n
    except UnicodeDecodeError as exc:
        raise DecodeError(RelayTag.BAD_FRAME, f"offer's {what} is not ASCII") from exc


def decode_relay(data: bytes) -> Offer | Relayed:
    """Strict: an unknown kind, a short or over-long offer or non-ASCII text raises `DecodeError`."""
    if len(data) < _RELAYED.size:
        raise DecodeError(RelayTag.BAD_FRAME, f"relay frame of {len(data)} bytes")
    kind = data[0]
    if kind == RelayKind.UPDATE:
        return Relayed(data[1], bytes(data[_RELAYED.size :]))
    if kind != RelayKind.OFFER:
        raise DecodeError(RelayTag.BAD_FRAME, f"unknown relay frame kind {kind}")
    if not _OFFER.size <= len(data) <= MAX_OFFER_BYTES:
        raise DecodeError(RelayTag.BAD_FRAME, f"offer of {len(data)} bytes")
    _, hop, fragment, from_version, term = _OFFER.unpack_from(data)
    leader, at = _read_text(data, _OFFER.size, "leader")
    checksum, at = _read_text(data, at, "checksum")
    if at != len(data):
        raise DecodeError(RelayTag.BAD_FRAME, f"{len(data) - at} bytes after the offer")
    return Offer(UpdateId(fragment, from_version, term, leader, checksum), hop)
