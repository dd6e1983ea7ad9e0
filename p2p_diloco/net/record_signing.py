"""Record signatures with a peer's RSA identity (`net.identity`), for `wire.signing`'s interfaces.

A signature is ``len(public key DER) (2 bytes) | public key DER | RSA-PKCS1v15-SHA256 signature``: the
checker derives the peer ID from the embedded key (as p2pd does) and compares it with the claimed signer,
so checking needs no key lookup. A malformed signature is simply not valid.
"""

from __future__ import annotations

import os

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from p2p_diloco.net.identity import load_identity, peer_id_of_rsa_public
from p2p_diloco.wire.frames import MAX_SIGNATURE_BYTES


class RsaRecordSigner:
    """Signs as the peer whose identity file is `key_path`."""

    def __init__(self, key_path: str | os.PathLike[str]):
        self._key = load_identity(key_path)
        self.peer_id = peer_id_of_rsa_public(self._key.public_key())
        der = self._key.public_key().public_bytes(
            encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo
        )
        self._prefix = len(der).to_bytes(2, "big") + der

    def sign(self, data: bytes) -> bytes:
        return self._prefix + self._key.sign(data, padding.PKCS1v15(), hashes.SHA256())


class RsaSignatureCheck:
    """Checks signatures made by `RsaRecordSigner` (any peer's)."""

    def verify(self, peer_id: str, data: bytes, signature: bytes) -> bool:
        if not 2 < len(signature) <= MAX_SIGNATURE_BYTES:
            return False
        size = int.from_bytes(signature[:2], "big")
        der, sig = signature[2 : 2 + size], signature[2 + size :]
        try:
            key = serialization.load_der_public_key(der)
        except ValueError:
            return False
        if not isinstance(key, rsa.RSAPublicKey) or peer_id_of_rsa_public(key) != peer_id:
            return False
        try:
            key.verify(sig, data, padding.PKCS1v15(), hashes.SHA256())
        except InvalidSignature:
            return False
        return True
