"""Peer identity: the RSA private key file that fixes a peer's ID, and the ID <-> public key mapping.

The file format is hivemind's own (`P2P.generate_identity`): a libp2p `crypto.pb.PrivateKey` protobuf
holding an RSA key in DER, so the same file works as `identity_path=` for hivemind's p2pd and as the
signing key of `RSASignatureValidator`. With one key for both, a DHT record's owner tag (an ssh-rsa
public key) maps to exactly one peer ID (`peer_id_of_public_key`), which is how `dht_store` ties a
signed record to the peer that wrote it. RSA peer IDs start with ``Qm``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import base58
import multihash
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from p2p_diloco.errors import ConfigError
from p2p_diloco.files import atomic_file

if TYPE_CHECKING:
    from hivemind.utils.crypto import RSAPrivateKey

KEY_FILE_MODE = 0o600
RSA_KEY_BITS = 2048
KEY_TYPES = {0: "RSA", 1: "Ed25519", 2: "Secp256k1", 3: "ECDSA"}  # libp2p crypto.pb.KeyType
_RSA = 0

# libp2p's `crypto.pb.PrivateKey`/`PublicKey` are two-field protobufs (key_type = 1: varint, data = 2:
# bytes). They are encoded here by hand so that keygen and key checks need not import hivemind (2 s);
# tests compare the result with hivemind's `crypto_pb2` and with the ID p2pd reports.


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _encode_key_proto(key_type: int, data: bytes) -> bytes:
    return b"\x08" + _varint(key_type) + b"\x12" + _varint(len(data)) + data


def _read_varint(blob: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(blob) or shift > 63:
            raise ValueError("truncated varint")
        byte = blob[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            return value, pos


def _decode_key_proto(blob: bytes) -> tuple[int, bytes]:
    key_type, data, pos = None, None, 0
    while pos < len(blob):
        tag, pos = _read_varint(blob, pos)
        if tag == 0x08:
            key_type, pos = _read_varint(blob, pos)
        elif tag == 0x12:
            length, pos = _read_varint(blob, pos)
            if pos + length > len(blob):
                raise ValueError("truncated key data")
            data, pos = blob[pos : pos + length], pos + length
        else:
            raise ValueError(f"unexpected protobuf field tag {tag}")
    if key_type is None or not data:
        raise ValueError("key type or key data missing")
    return key_type, data


def _encode_identity(private_key: rsa.RSAPrivateKey) -> bytes:
    der = private_key.private_bytes(
        encoding=serialization.Encoding.DER,
        format=serialization.PrivateFormat.TraditionalOpenSSL,
        encryption_algorithm=serialization.NoEncryption(),
    )
    return _encode_key_proto(_RSA, der)


@lru_cache(maxsize=8)
def _private_key_from_der(data: bytes) -> object:
    """Parsing an RSA key costs ~35 ms and a peer's start reads its identity several times (peer ID,
    DHT, record signing): the same bytes give the same immutable key, so it is parsed once."""
    return serialization.load_der_private_key(data, password=None)


def _decode_identity(blob: bytes, where: str) -> rsa.RSAPrivateKey:
    hint = "create one with `p2p-diloco keygen --out PATH`"
    try:
        key_type, data = _decode_key_proto(blob)
    except ValueError as exc:
        raise ConfigError(f"{where} is not a peer identity key file ({exc}); {hint}") from exc
    if key_type != _RSA:
        kind = KEY_TYPES.get(key_type, f"unknown type {key_type}")
        raise ConfigError(f"{where} holds a {kind} key; only RSA identities are supported here; {hint}")
    try:
        key = _private_key_from_der(data)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{where} holds a corrupt RSA key ({exc}); {hint}") from exc
    if not isinstance(key, rsa.RSAPrivateKey):
        raise ConfigError(f"{where} does not hold an RSA private key; {hint}")
    return key


def load_identity(key_path: str | os.PathLike[str]) -> rsa.RSAPrivateKey:
    """The RSA private key in `key_path`; `ConfigError` saying what is wrong if missing or corrupt."""
    path = Path(key_path)
    if not path.is_file():
        raise ConfigError(
            f"identity file {path} does not exist; create one with `p2p-diloco keygen --out {path}`"
        )
    try:
        blob = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read identity file {path}: {exc.strerror}") from exc
    return _decode_identity(blob, f"identity file {path}")


def peer_id_of_rsa_public(public_key: rsa.RSAPublicKey) -> str:
    der = public_key.public_bytes(
        encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo
    )
    encoded = _encode_key_proto(_RSA, der)
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return base58.b58encode(digest).decode()


def peer_id_of(key_path: str | os.PathLike[str]) -> str:
    """The libp2p peer ID (``Qm...``) that p2pd derives from the identity file `key_path`."""
    return peer_id_of_rsa_public(load_identity(key_path).public_key())


def public_key_proto(private_key: rsa.RSAPrivateKey) -> bytes:
    """The libp2p `crypto.pb.PublicKey` protobuf of an identity's public key (what its peer ID hashes)."""
    der = private_key.public_key().public_bytes(
        encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return _encode_key_proto(_RSA, der)


def public_key_from_proto(blob: bytes) -> tuple[rsa.RSAPublicKey, str]:
    """The RSA public key in a libp2p `PublicKey` protobuf and the peer ID it gives.

    Raises `ValueError` if the bytes are not such a protobuf holding an RSA key.
    """
    key_type, data = _decode_key_proto(blob)
    if key_type != _RSA:
        raise ValueError(f"a {KEY_TYPES.get(key_type, f'type {key_type}')} key, not RSA")
    key = serialization.load_der_public_key(data)
    if not isinstance(key, rsa.RSAPublicKey):
        raise ValueError("not an RSA public key")
    return key, peer_id_of_rsa_public(key)


@lru_cache(maxsize=4096)
def peer_id_of_public_key(ssh_public_key: bytes) -> str:
    """Peer ID of an ssh-rsa public key as it appears in an `RSASignatureValidator` owner tag.

    Raises `ValueError` if the bytes are not an RSA public key.
    """
    key = serialization.load_ssh_public_key(ssh_public_key)
    if not isinstance(key, rsa.RSAPublicKey):
        raise ValueError("owner tag does not hold an RSA public key")
    return peer_id_of_rsa_public(key)


def signing_key(key_path: str | os.PathLike[str]) -> RSAPrivateKey:
    """The identity as hivemind's `RSAPrivateKey`, for `RSASignatureValidator(private_key=...)`.

    hivemind's class only generates fresh keys in its constructor; its pickling protocol
    (`__setstate__` with DER bytes) is the public way to load an existing one.
    """
    der = load_identity(key_path).private_bytes(
        encoding=serialization.Encoding.DER,
        format=serialization.PrivateFormat.TraditionalOpenSSL,
        encryption_algorithm=serialization.NoEncryption(),
    )
    return _hivemind_key(der)


@lru_cache(maxsize=8)
def _hivemind_key(der: bytes) -> RSAPrivateKey:
    from hivemind.utils.crypto import RSAPrivateKey

    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": der})
    return key


def write_identity(key_path: str | os.PathLike[str], *, force: bool = False) -> str:
    """Write a fresh RSA identity to `key_path` (mode 0600) and return its peer ID.

    Refuses to replace an existing file unless `force`; the new file appears atomically.
    """
    path = Path(key_path)
    if path.is_dir():
        raise ConfigError(f"--out {path} is a directory; give a file path such as {path / 'peer.key'}")
    if path.exists() and not force:
        raise ConfigError(
            f"{path} already exists (peer id {_describe_existing(path)}); "
            "pass --force to overwrite it (the old peer ID is lost)"
        )
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError(f"directory {parent} for --out does not exist; create it first")
    key = rsa.generate_private_key(public_exponent=65537, key_size=RSA_KEY_BITS)
    blob = _encode_identity(key)
    try:
        with atomic_file(path, mode=KEY_FILE_MODE, exclusive=not force) as f:
            f.write(blob)
    except FileExistsError as exc:
        raise ConfigError(f"{path} was created by someone else meanwhile; pass --force to overwrite") from exc
    return peer_id_of_rsa_public(key.public_key())


def _describe_existing(path: Path) -> str:
    try:
        return peer_id_of(path)
    except ConfigError:
        return "unknown: not a valid key file"


def cli_keygen(args: argparse.Namespace) -> int:
    """`p2p-diloco keygen --out PATH [--force]`: write a key file and print its peer ID."""
    peer_id = write_identity(args.out, force=bool(args.force))
    print(f"wrote {args.out} (mode 0600)")
    print(f"peer id: {peer_id}", flush=True)
    return 0
