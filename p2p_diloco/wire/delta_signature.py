"""Signed deltas: the exact bytes a learner signs for one delta, their strict parser, and the check a replica
runs on a delta an update record lists.

Under union aggregation an update record lists the deltas it merged (learner, seq, payload digest,
weight) and every replica fetches those deltas and merges them itself; the synchronizer only chooses
which. So each delta carries its learner's signature, made with the learner's record-signing identity
(`wire.signing.RecordSigner`: RSA in a real node, `net.record_signing`; per-peer secrets in process),
over these bytes, all integers little-endian::

    magic b"PDds" | version u8 | run_id (u8 length, ASCII) | manifest_hash (u8 length, ASCII) |
    learner (u8 length, ASCII) | fragment u16 | anchor_version u64 | seq u64 | tokens u64 |
    payload digest (32 bytes: BLAKE2b-256 of the `wire.codecs.codec` frame)

The learner's own ID is inside, so a signature cannot be replayed under another name, and so are its
tokens: the record's weight for the delta must equal them. The run and manifest hash keep a delta from
one run out of another; fragment, anchor version and seq pin the delta to the state it was trained from.

`check_listed_delta` tells a replica whether a fetched delta is the one a record listed, and why not:
`DeltaRefusal` reasons, every one a reason to refuse the whole record.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from enum import StrEnum

from p2p_diloco.errors import DecodeError
from p2p_diloco.protocol.messages import ListedDelta
from p2p_diloco.wire.bounds import MAX_COUNTER, MAX_FRAGMENT, MAX_ID_CHARS, MAX_SIGNATURE_BYTES
from p2p_diloco.wire.codecs.blockwise import (
    BAD_HEADER,
    TRAILING_BYTES,
    UNSUPPORTED_VERSION,
    ByteReader,
    byte_view,
)
from p2p_diloco.wire.signing import RecordSigner, SignatureCheck

MAGIC = b"PDds"
VERSION = 1
DIGEST_BYTES = 32
_NUMBERS = struct.Struct("<HQQQ")
MAX_SIGNING_BYTES = len(MAGIC) + 1 + 3 * (1 + MAX_ID_CHARS) + _NUMBERS.size + DIGEST_BYTES


class DeltaRefusal(StrEnum):
    """Why a replica refuses a record over one delta it lists."""

    DIGEST_MISMATCH = "digest mismatch"  # the fetched payload's digest is not the listed one
    BAD_SIGNATURE = "bad signature"  # not the listed learner's signature over the listed delta
    WEIGHT_MISMATCH = "weight mismatch"  # the listed weight is above the tokens the learner signed (or < 1)
    WRONG_DELTA = "wrong delta"  # the fetched delta is of another run, fragment, learner or seq


def payload_digest(payload: bytes) -> bytes:
    """BLAKE2b-256 of a delta's `wire.codecs.codec` frame, as `update_signing_bytes` digests payloads."""
    return hashlib.blake2b(byte_view(payload), digest_size=DIGEST_BYTES).digest()


def identifier_problem(value: object) -> str | None:
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_ID_CHARS:
        return f"must be a string of 1-{MAX_ID_CHARS} characters"
    if not all(c.isascii() and (c.isalnum() or c in "-_.:") for c in value):
        return "may hold only ASCII letters, digits, '-', '_', '.', ':'"
    return None


@dataclass(frozen=True)
class SignedDelta:
    """What a learner signs for one delta."""

    run_id: str
    manifest_hash: str
    learner: str
    fragment: int
    anchor_version: int
    seq: int
    tokens: int
    digest: bytes

    def problem(self) -> str | None:
        """Why these fields cannot be signed (out of range), or None."""
        for name in ("run_id", "manifest_hash", "learner"):
            problem = identifier_problem(getattr(self, name))
            if problem is not None:
                return f"{name} {problem}"
        for name, high in (
            ("fragment", MAX_FRAGMENT),
            *((n, MAX_COUNTER) for n in ("anchor_version", "seq", "tokens")),
        ):
            value = getattr(self, name)
            if type(value) is not int or not 0 <= value <= high:
                return f"{name} must be an integer in [0, {high}], got {value!r}"
        if not isinstance(self.digest, bytes) or len(self.digest) != DIGEST_BYTES:
            return f"digest must be {DIGEST_BYTES} bytes"
        return None


def delta_signing_bytes(delta: SignedDelta) -> bytes:
    """The bytes a learner signs for `delta` (layout in the module docstring); ValueError if out of range."""
    problem = delta.problem()
    if problem is not None:
        raise ValueError(f"cannot sign delta: {problem}")
    ids = b"".join(
        bytes([len(v)]) + v.encode("ascii") for v in (delta.run_id, delta.manifest_hash, delta.learner)
    )
    numbers = _NUMBERS.pack(delta.fragment, delta.anchor_version, delta.seq, delta.tokens)
    return b"".join((MAGIC, bytes([VERSION]), ids, numbers, delta.digest))


def parse_delta_signing_bytes(data: bytes) -> SignedDelta:
    """The fields of `delta_signing_bytes` output; raises only `DecodeError` (exact size, valid fields)."""
    view = byte_view(data)
    reader = ByteReader(view, MAX_SIGNING_BYTES)
    reader.expect_magic(MAGIC, "signed delta")
    (version,) = reader.take(1, "signed delta version")
    if version != VERSION:
        raise DecodeError(UNSUPPORTED_VERSION, f"signed delta version {version}, this peer reads {VERSION}")
    ids = []
    for name in ("run_id", "manifest_hash", "learner"):
        (size,) = reader.take(1, f"{name} length")
        raw = reader.take(size, name)
        try:
            ids.append(raw.decode("ascii"))
        except UnicodeDecodeError:
            raise DecodeError(BAD_HEADER, f"signed delta {name} is not ASCII") from None
    fragment, anchor, seq, tokens = reader.unpack(_NUMBERS, "signed delta numbers")
    digest = reader.take(DIGEST_BYTES, "signed delta digest")
    if reader.pos != len(view):
        raise DecodeError(TRAILING_BYTES, f"{len(view) - reader.pos} bytes after the signed delta")
    delta = SignedDelta(*ids, fragment, anchor, seq, tokens, digest)
    problem = delta.problem()
    if problem is not None:
        raise DecodeError(BAD_HEADER, f"signed delta: {problem}")
    return delta


def sign_delta(signer: RecordSigner, delta: SignedDelta) -> bytes:
    """`signer`'s signature over `delta`; ValueError unless `signer` is the delta's learner."""
    if signer.peer_id != delta.learner:
        raise ValueError(f"{signer.peer_id} cannot sign a delta of {delta.learner}")
    return signer.sign(delta_signing_bytes(delta))


def check_listed_delta(
    check: SignatureCheck,
    listed: ListedDelta,
    *,
    run_id: str,
    manifest_hash: str,
    fragment: int,
    signed: SignedDelta,
    signature: bytes,
    payload: bytes,
) -> tuple[DeltaRefusal, str] | None:
    """None when `payload` with `signed` and `signature` is the delta `listed` names for this run and
    fragment, signed by its learner; else the refusal and a detail for the record's rejection."""
    if signed.problem() is not None:
        return DeltaRefusal.WRONG_DELTA, f"fetched delta fields out of range: {signed.problem()}"
    if (signed.run_id, signed.manifest_hash, signed.fragment) != (run_id, manifest_hash, fragment) or (
        signed.learner,
        signed.seq,
    ) != (listed.learner, listed.seq):
        return DeltaRefusal.WRONG_DELTA, f"fetched {signed.learner}/{signed.seq} is not the listed delta"
    if payload_digest(payload) != listed.digest or signed.digest != listed.digest:
        return DeltaRefusal.DIGEST_MISMATCH, f"{listed.learner}/{listed.seq}: payload digest differs"
    if len(signature) > MAX_SIGNATURE_BYTES or not check.verify(
        listed.learner, delta_signing_bytes(signed), signature
    ):
        return DeltaRefusal.BAD_SIGNATURE, f"{listed.learner}/{listed.seq}: signature does not check"
    if not 1 <= listed.weight <= signed.tokens:  # the holder weighs a delta at most by its signed tokens
        return (
            DeltaRefusal.WEIGHT_MISMATCH,
            f"{listed.learner}/{listed.seq}: weight {listed.weight} not in [1, {signed.tokens}], its tokens",
        )
    return None
