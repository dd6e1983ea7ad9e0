"""Signatures on records that travel through third parties: the interface the swarm uses, and its
in-memory version for the in-process swarm and tests.

An update record is pushed by its leader but also replayed by any peer that logged it, and vouches for
the checksum a snapshot must match. A replaying peer may be hostile, so the record carries its leader's
signature over the record's own bytes (`wire.frames.update_signing_bytes`), and every replica checks it
before anything else: a forged record naming an honest leader is refused.

`RecordSigner` signs as one peer; `SignatureCheck` tells whether a signature is `peer`'s over `data`.
The real node signs with its RSA identity (`net.record_signing`, the public key travels inside the
signature so the check needs nothing but the peer ID); `InMemoryKeys` gives each in-process peer a secret
that only its own signer holds.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Protocol


class RecordSigner(Protocol):
    peer_id: str

    def sign(self, data: bytes) -> bytes: ...


class SignatureCheck(Protocol):
    def verify(self, peer_id: str, data: bytes, signature: bytes) -> bool:
        """True only if `signature` was made over `data` by `peer_id`'s key."""
        ...


@dataclass(frozen=True)
class PeerKeys:
    """What a peer signs with, and how it checks the others."""

    signer: RecordSigner
    check: SignatureCheck


class InMemoryKeys:
    """A keyring of per-peer secrets for peers living in one process (in-process swarm, tests): a peer's
    signer holds its own secret only, so a hostile in-process peer cannot sign as another."""

    def __init__(self, seed: str | None = None) -> None:
        """`seed`: derive each peer's secret from it (a simulator's run replays bit for bit); random else."""
        self._secrets: dict[str, bytes] = {}
        self._seed = seed

    def _new_secret(self, peer_id: str) -> bytes:
        if self._seed is None:
            return secrets.token_bytes(32)
        return hashlib.blake2b(f"{self._seed}:{peer_id}".encode(), digest_size=32).digest()

    def signer(self, peer_id: str) -> _InMemorySigner:
        if peer_id not in self._secrets:
            self._secrets[peer_id] = self._new_secret(peer_id)
        secret = self._secrets[peer_id]
        return _InMemorySigner(peer_id, secret)

    def for_peer(self, peer_id: str) -> PeerKeys:
        return PeerKeys(self.signer(peer_id), self)

    def verify(self, peer_id: str, data: bytes, signature: bytes) -> bool:
        secret = self._secrets.get(peer_id)
        if secret is None:
            return False
        return hmac.compare_digest(signature, _mac(secret, data))


class _InMemorySigner:
    def __init__(self, peer_id: str, secret: bytes):
        self.peer_id = peer_id
        self._secret = secret

    def sign(self, data: bytes) -> bytes:
        return _mac(self._secret, data)


def _mac(secret: bytes, data: bytes) -> bytes:
    return hmac.new(secret, hashlib.blake2b(data, digest_size=32).digest(), "sha256").digest()
