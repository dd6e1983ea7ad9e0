"""No silent fresh start (#31): proofs that a run is under way, and the wait they turn a claim into."""

from __future__ import annotations

from dataclasses import replace

from p2p_diloco.protocol import election
from p2p_diloco.protocol.claim_guard import ClaimChecks
from p2p_diloco.protocol.claim_guard import gate as gate_claim
from p2p_diloco.protocol.election import ElectionDecision, PeerHeartbeat
from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.swarm import effects as fx
from p2p_diloco.swarm.election.membership import SwarmView
from p2p_diloco.swarm.election.underway import UnderwayGate
from p2p_diloco.swarm.journal import Journal
from p2p_diloco.wire.interfaces import StoredValue
from p2p_diloco.wire.underway import check_proof, encode_proof
from tests.support.manifests import tiny_manifest
from tests.support.peers import KEYS, signed

OPEN = tiny_manifest("underway")


def record(manifest=OPEN, leader: str = "sync", version: int = 6, term: int = 3) -> UpdateRecord:  # noqa: ANN001
    return UpdateRecord(
        run_id=manifest.run_id,
        manifest_hash=manifest.manifest_hash,
        fragment=1,
        from_version=version - 1,
        term=term,
        leader=leader,
        contributors=(("a", 1.0),),
        checksum="c" * 16,
        payload=b"payload bytes",
    )


def check(value: bytes, manifest=OPEN):  # noqa: ANN001, ANN201
    return check_proof(
        value,
        run_id=manifest.run_id,
        manifest_hash=manifest.manifest_hash,
        check=KEYS,
        may_synchronize=manifest.may_synchronize,
    )


def test_a_signed_records_proof_shows_the_run_under_way_and_nothing_else_does():
    found = check(encode_proof(signed(record())))
    assert not isinstance(found, str)
    assert (found.fragment, found.version, found.term, found.leader) == (1, 6, 3, "sync")
    assert check(encode_proof(record())) == "bad proof signature"  # unsigned
    forged = encode_proof(replace(signed(record()), term=9))  # a carrier raised the term
    assert check(forged) == "bad proof signature"
    assert check(b"not json") == "malformed proof"
    assert check(b"x" * 20_000) == "proof too large"
    other = tiny_manifest("another-run")
    assert check(encode_proof(signed(record(other))), OPEN) == "proof of another run"


def test_only_records_of_peers_that_may_synchronize_count():
    listed = replace(OPEN, allowlist=("sync",))  # the allowlist plays the authority's part
    assert not isinstance(check(encode_proof(signed(record(listed))), listed), str)
    by_stranger = encode_proof(signed(record(listed, leader="stranger")))
    assert check(by_stranger, listed) == "proof signed by stranger, who may not synchronize"


def claim(term: int = 1) -> ElectionDecision:
    return ElectionDecision(election.CLAIM, f"claim: term {term}, rank 1 of 1", term=term, holder="me")


def view_of(*peers: str) -> SwarmView:
    beats = [PeerHeartbeat(p, may_sync=True, reachable=True, versions=(0, 0), expires_at=10.0) for p in peers]
    return SwarmView(heartbeats=beats, leases=[])


def test_a_fresh_peer_is_no_candidate_of_a_run_under_way_and_a_stranger_cannot_make_it_one():
    journal = Journal("me", lambda _: None)
    gate = UnderwayGate("me", OPEN, KEYS, journal)
    assert gate.election_view(view_of("me"), (0, 0)) == view_of("me")  # a new run: start as today
    assert gate.claim_wait() is None
    gate.ingest({"junk": StoredValue(b"{}", 1.0), "forged": StoredValue(encode_proof(record()), 1.0)})
    assert gate.best is None and journal.rejections["bad underway proof"] == 2
    gate.ingest({"carrier": StoredValue(encode_proof(signed(record())), 1.0)})
    assert [hb.peer_id for hb in gate.election_view(view_of("me", "other"), (0, 0)).heartbeats] == ["other"]
    assert gate.waiting is not None and gate.waiting.startswith(
        "run under way: fragment 1 v6 term 3 signed by sync"
    )
    assert sum("run under way" in line for line in journal.decisions) == 1
    gate.election_view(view_of("me"), (0, 0))
    assert sum("run under way" in line for line in journal.decisions) == 1  # not every tick
    for _ in range(3):
        journal.note("election: wait: no candidates")
    gate.election_view(view_of("me"), (0, 0))
    assert "run under way" in journal.decisions[-1]  # but kept among the lines `status` shows
    checks = ClaimChecks(under_way=gate.claim_wait())
    held = gate_claim(claim(4), checks)  # a claim the election still made (a remembered candidate: me)
    assert held.action == election.WAIT and held.reason == gate.waiting
    follow = ElectionDecision(election.FOLLOW, "held by: sync term 3", term=3, holder="sync")
    assert gate_claim(follow, checks) == follow  # following a live holder is never held back
    assert gate.election_view(view_of("me"), (0, 6)) == view_of("me")  # applied updates: not a fresh start
    assert gate.waiting is None and gate.claim_wait() is None and not gate.reading


def test_a_peer_publishes_its_newest_signed_record_as_a_proof_now_and_then():
    from p2p_diloco.swarm.update_log import UpdateLog

    gate = UnderwayGate("me", OPEN, KEYS, Journal("me", lambda _: None))
    log = UpdateLog([10, 10], budget_bytes=1 << 20, max_length=8)
    assert gate.publish(log, 2, 0.0) is None
    log.append(signed(record(version=1)))
    log.append(signed(record(version=2)))
    first = gate.publish(log, 2, 0.0)
    assert isinstance(first, fx.StoreRecord) and first.key == gate.key and first.subkey == "me"
    assert not isinstance(found := check(first.value), str) and found.version == 2
    assert gate.publish(log, 2, 0.5) is None  # written again only after half its lifetime


def test_an_update_a_fresh_peer_is_sent_proves_the_run_under_way_only_when_signed():
    """`UnderwayGate.witness` (seed 10 of the simulator): an unsigned or altered record proves nothing and
    costs no offence count; a signed one from a peer that may synchronize holds the fresh peer back."""
    journal = Journal("me", lambda _: None)
    gate = UnderwayGate("me", OPEN, KEYS, journal)
    gate.witness(record())  # no signature
    gate.witness(replace(signed(record()), term=9))  # signed, then altered on the way
    assert gate.best is None and journal.rejections["bad underway proof"] == 0
    gate.witness(signed(record()))
    assert gate.best is not None
    assert [hb.peer_id for hb in gate.election_view(view_of("me", "other"), (0, 0)).heartbeats] == ["other"]
