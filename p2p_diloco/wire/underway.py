"""Proof that a run is under way: an update record's signed header, without its payload.

A peer that finds nobody must not start an under-way run again from version 0 (its term 1 would fork the
run; issue #31). What tells it is not a stranger's word (a heartbeat's versions, a bootstrap node saying
"the run started") but a record backed by the authority's chain (docs/security.md, "Where trust comes
from"): the header of an outer update, signed by its leader, where the leader may synchronize. Only a
peer that may synchronize can make one, nobody can forge one, and anyone may carry one: peers publish the
newest record they applied under the run's ``underway`` DHT key, and a bootstrap node keeps the best one it
read in its state file and publishes it again after a restart, when no peer of the run is in reach.

The proof holds every header field the leader signed (`wire.frames.update_signing_bytes`) and the digest
of the payload, so a reader rebuilds the signed bytes and checks the signature with nothing but the
leader's peer ID. A proof of a record of another run or manifest is refused (both are in the header).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass

from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.wire.frames import UPDATE_MAGIC, _update_fields
from p2p_diloco.wire.signing import SignatureCheck

MAX_PROOF_BYTES = 16_384


@dataclass(frozen=True, order=True)
class Underway:
    """What a checked proof shows: `fragment` reached `version` in `term`, published by `leader`."""

    term: int
    version: int
    fragment: int
    leader: str

    def describe(self) -> str:
        return f"fragment {self.fragment} v{self.version} term {self.term} signed by {self.leader}"


def encode_proof(record: UpdateRecord) -> bytes:
    """The proof for a signed update record (its header fields, payload digest and signature)."""
    fields = _update_fields(record)
    signature = fields.pop("signature")
    digest = hashlib.blake2b(record.payload, digest_size=32).hexdigest()
    body = {"header": fields, "payload_digest": digest, "signature": signature}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def check_proof(
    value: bytes,
    *,
    run_id: str,
    manifest_hash: str,
    check: SignatureCheck,
    may_synchronize: Callable[[str], bool],
) -> Underway | str:
    """The `Underway` a proof shows, or why it shows nothing (a reason string)."""
    if len(value) > MAX_PROOF_BYTES:
        return "proof too large"
    try:
        body = json.loads(value)
        header, digest, signature = body["header"], bytes.fromhex(body["payload_digest"]), body["signature"]
        leader, fragment, version = header["leader"], header["fragment"], header["from_version"] + 1
        term = header["term"]
        if not (isinstance(leader, str) and isinstance(term, int) and isinstance(fragment, int)):
            return "malformed proof"
        sig = bytes.fromhex(signature)
    except (ValueError, KeyError, TypeError, AttributeError):
        return "malformed proof"
    if (header.get("run_id"), header.get("manifest_hash")) != (run_id, manifest_hash):
        return "proof of another run"
    if term < 1 or version < 1 or len(digest) != 32:
        return "malformed proof"
    if not may_synchronize(leader):
        return f"proof signed by {leader}, who may not synchronize"
    signed = json.dumps(header, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    if not check.verify(leader, b"".join((UPDATE_MAGIC, b"sig1", signed, digest)), sig):
        return "bad proof signature"
    return Underway(term=term, version=version, fragment=fragment, leader=leader)
