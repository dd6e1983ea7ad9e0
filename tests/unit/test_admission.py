"""Which DHT records a peer reads (`net.admission`): allowed writers only, a bounded number per key."""

from __future__ import annotations

import pytest

from p2p_diloco.config import RunManifest, TrustConfig
from p2p_diloco.net.admission import RecordAdmission, admission_for, listed_peers, stream_admission
from p2p_diloco.wire import keys


def peer(tag: str) -> str:
    return "Qm" + tag * (44 // len(tag))


AUTHORITY, SYNC, LEARNER, STRANGER = peer("A"), peer("S"), peer("L"), peer("X")


def test_public_run_reads_leases_only_from_synchronizers_and_other_records_from_allowed_peers():
    trust = TrustConfig(authority=AUTHORITY, synchronizers=(SYNC,), learners=(LEARNER,))
    manifest = RunManifest(run_id="pub", trust=trust)
    admission = admission_for(manifest)
    lease = keys.lease_key(manifest.run_id, manifest.manifest_hash)
    heartbeat = keys.heartbeat_key(manifest.run_id, manifest.manifest_hash)
    assert admission.allows(lease, SYNC) and not admission.allows(lease, LEARNER)
    assert admission.allows(heartbeat, SYNC) and admission.allows(heartbeat, LEARNER)
    assert not admission.allows(heartbeat, STRANGER) and not admission.allows(lease, STRANGER)
    assert listed_peers(manifest) == {AUTHORITY, SYNC, LEARNER}


def test_an_open_run_reads_anyone_and_an_allowlist_narrows_it():
    open_run = admission_for(RunManifest(run_id="open"))
    key = keys.heartbeat_key("open", RunManifest(run_id="open").manifest_hash)
    assert open_run.allows(key, STRANGER) and open_run.listed == frozenset()
    private = RunManifest(run_id="priv", allowlist=(LEARNER,))
    assert not admission_for(private).allows(key, STRANGER) and admission_for(private).allows(key, LEARNER)


def test_excess_records_are_cut_by_one_rule_listed_peers_first():
    admission = RecordAdmission(lambda key, p: True, listed=frozenset({"vip"}), max_subkeys=3)
    records = {f"peer-{i}": i for i in range(10)} | {"vip": -1}
    kept, excess = admission.bound("k", records)
    assert len(kept) == 3 and excess == 8 and "vip" in kept
    shuffled = dict(reversed(list(records.items())))  # another reader, another order: the same records
    assert admission.bound("k", shuffled) == (kept, excess)
    assert admission.bound("k", {"a": 1}) == ({"a": 1}, 0)
    with pytest.raises(ValueError, match="max_subkeys"):
        RecordAdmission(lambda key, p: True, max_subkeys=0)


def test_transport_requests_follow_the_same_rule_updates_only_from_synchronizers():
    trust = TrustConfig(authority=AUTHORITY, synchronizers=(SYNC,), learners=(LEARNER,))
    admit = stream_admission(RunManifest(run_id="pub", trust=trust))
    assert admit(keys.OP_UPDATE, SYNC) and not admit(keys.OP_UPDATE, LEARNER)
    for op in (keys.OP_DELTA, keys.OP_FETCH_UPDATES, keys.OP_FETCH_SNAPSHOT, "a-new-fetch-op"):
        assert admit(op, LEARNER) and admit(op, SYNC) and not admit(op, STRANGER)
    assert admit(keys.OP_RELAY, LEARNER) and admit(keys.OP_RELAY, SYNC) and not admit(keys.OP_RELAY, STRANGER)
    assert stream_admission(RunManifest(run_id="open"))(keys.OP_UPDATE, STRANGER)  # no lists: anyone
