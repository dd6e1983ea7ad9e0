"""`p2p-diloco keygen` and identity files: mode 0600, no silent overwrite, stable IDs, clear errors."""

from __future__ import annotations

import argparse
import stat

import pytest

from p2p_diloco.errors import ConfigError
from p2p_diloco.net.identity import (
    cli_keygen,
    load_identity,
    peer_id_of,
    peer_id_of_public_key,
    write_identity,
)


def keygen(out, force=False) -> int:
    return cli_keygen(argparse.Namespace(out=str(out), force=force))


def test_keygen_writes_mode_0600_and_prints_the_stable_peer_id(tmp_path, capsys):
    out = tmp_path / "peer.key"
    assert keygen(out) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    printed = capsys.readouterr().out.splitlines()
    peer_line = [line for line in printed if line.startswith("peer id: ")]
    assert len(peer_line) == 1
    peer_id = peer_line[0].removeprefix("peer id: ")
    assert peer_id.startswith("Qm")
    assert peer_id_of(out) == peer_id == peer_id_of(out)  # same file, same ID, every time
    assert list(tmp_path.iterdir()) == [out]  # no temporary file left behind


def test_keygen_refuses_to_overwrite_without_force(tmp_path):
    out = tmp_path / "peer.key"
    first = write_identity(out)
    before = out.read_bytes()
    with pytest.raises(ConfigError, match=rf"already exists \(peer id {first}\).*--force"):
        keygen(out)
    assert out.read_bytes() == before
    second = write_identity(out, force=True)
    assert second != first and peer_id_of(out) == second
    assert stat.S_IMODE(out.stat().st_mode) == 0o600


def test_keygen_into_a_missing_directory_says_so(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        keygen(tmp_path / "no-such-dir" / "peer.key")


@pytest.mark.parametrize(
    "content, match",
    [
        (b"", "not a peer identity key file"),
        (b"-----BEGIN RSA PRIVATE KEY-----\n", "not a peer identity key file"),
        (b"\x08\x01\x12\x03abc", "Ed25519 key; only RSA"),
        (b"\x08\x00\x12\x05abcde", "corrupt RSA key"),
        (b"\x08\x00\x12\x50abc", "truncated"),
    ],
)
def test_a_wrong_or_corrupt_key_file_gives_a_clear_error(tmp_path, content, match):
    bad = tmp_path / "bad.key"
    bad.write_bytes(content)
    with pytest.raises(ConfigError, match=match):
        peer_id_of(bad)


def test_a_missing_key_file_points_to_keygen(tmp_path):
    with pytest.raises(ConfigError, match="does not exist.*p2p-diloco keygen"):
        load_identity(tmp_path / "nope.key")


def test_file_format_and_peer_id_match_hivemind(tmp_path):
    from hivemind.p2p import PeerID
    from hivemind.proto import crypto_pb2

    out = tmp_path / "peer.key"
    peer_id = write_identity(out)
    blob = out.read_bytes()
    parsed = crypto_pb2.PrivateKey.FromString(blob)
    assert parsed.key_type == crypto_pb2.KeyType.RSA
    assert parsed.SerializeToString() == blob
    assert PeerID.from_identity(blob).to_base58() == peer_id


def test_owner_tag_public_key_maps_to_the_same_peer_id(tmp_path):
    from hivemind.dht.crypto import RSASignatureValidator

    from p2p_diloco.net.identity import signing_key

    out = tmp_path / "peer.key"
    peer_id = write_identity(out)
    tag = RSASignatureValidator(signing_key(out)).local_public_key
    assert tag.startswith(b"[owner:ssh-rsa ") and tag.endswith(b"]")
    assert peer_id_of_public_key(tag[len(b"[owner:") : -1]) == peer_id
