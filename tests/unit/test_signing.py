"""Signed update records (wire/signing.py, net/record_signing.py, wire/frames.py) and the states they
vouch for (swarm/vouching.py): a relayed record cannot be forged, a lone tip is not trusted."""

from __future__ import annotations

import dataclasses

import pytest

from p2p_diloco.net.identity import write_identity
from p2p_diloco.net.record_signing import RsaRecordSigner, RsaSignatureCheck
from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.protocol.reconcile import BranchTip
from p2p_diloco.swarm.vouching import Vouchers
from p2p_diloco.wire.frames import decode_update, encode_update, update_signing_bytes
from p2p_diloco.wire.signing import InMemoryKeys

RECORD = UpdateRecord("run", "0123456789abcdef", 0, 3, 2, "leader", (("a", 1.0),), "c0ffee", b"payload")


@pytest.fixture(scope="module")
def rsa_keys(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    signers = []
    for name in ("a", "b"):
        write_identity(folder / f"{name}.key")
        signers.append(RsaRecordSigner(folder / f"{name}.key"))
    return signers


def test_rsa_signature_verifies_only_for_its_signer_and_its_bytes(rsa_keys):
    alice, bob = rsa_keys
    check = RsaSignatureCheck()
    signature = alice.sign(b"data")
    assert check.verify(alice.peer_id, b"data", signature)
    assert not check.verify(bob.peer_id, b"data", signature)  # the embedded key is not bob's
    assert not check.verify(alice.peer_id, b"date", signature)
    for garbage in (b"", b"\x00", signature[:100], b"\xff" * 600, signature[:-1] + b"\x00"):
        assert not check.verify(alice.peer_id, b"data", garbage)


def test_in_memory_keys_sign_only_as_their_own_peer():
    keys = InMemoryKeys()
    mallory = keys.signer("mallory")
    keys.signer("leader")
    assert keys.verify("mallory", b"x", mallory.sign(b"x"))
    assert not keys.verify("leader", b"x", mallory.sign(b"x"))
    assert not keys.verify("stranger", b"x", mallory.sign(b"x"))


def test_the_signature_covers_every_field_and_the_payload_and_survives_the_wire():
    keys = InMemoryKeys()
    signed = dataclasses.replace(RECORD, signature=keys.signer("leader").sign(update_signing_bytes(RECORD)))
    decoded = decode_update(encode_update(signed), max_bytes=1 << 20)
    assert decoded == signed and keys.verify("leader", update_signing_bytes(decoded), decoded.signature)
    for change in (
        {"payload": b"payloae"},
        {"checksum": "c0fffe"},
        {"term": 3},
        {"contributors": (("a", 2.0),)},
    ):
        forged = dataclasses.replace(signed, **change)
        assert not keys.verify("leader", update_signing_bytes(forged), forged.signature)


def test_a_state_is_trusted_when_a_checked_record_or_two_peers_that_may_sync_vouch_for_it():
    vouchers = Vouchers(2)
    listed = {"a", "b", "c"}.__contains__  # the run's synchronizers; mallory and eve are unlisted keys
    lone = {"mallory": BranchTip(99, 50, "forged")}
    assert vouchers.trusted_tips(0, lone, listed) == {}
    two = {"a": BranchTip(2, 4, "x"), "b": BranchTip(2, 4, "x"), "mallory": BranchTip(99, 50, "forged")}
    assert set(vouchers.trusted_tips(0, two, listed)) == {"a", "b"}
    sybils = {"mallory": BranchTip(99, 50, "forged"), "eve": BranchTip(99, 50, "forged")}
    assert vouchers.trusted_tips(0, sybils, listed) == {}  # two unlisted keys alike: no evidence
    assert vouchers.credible_tips(0, {**sybils, "a": BranchTip(2, 4, "x")}, listed).keys() == {"a"}
    assert set(vouchers.trusted_tips(0, sybils, lambda peer: True)) == {"mallory", "eve"}  # an open run
    vouchers.vouch(RECORD)  # v3 -> v4 with checksum c0ffee, term 2
    assert vouchers.term_of(0, 4, "c0ffee") == 2 and vouchers.term_of(0, 4, "other") is None
    assert set(vouchers.trusted_tips(0, {"eve": BranchTip(2, 4, "c0ffee")}, listed)) == {"eve"}
    assert vouchers.newest(0) == 4 and vouchers.newest(1) == 0
