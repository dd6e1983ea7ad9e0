"""Sim tier (issue #41): a listed synchronizer that forges the merge of a union round is refused by every
replica, and the run goes on.

Whole peers (`swarm.peer.Peer`: elections, leases, pushes, relays, catch-up, refetch, reconciliation and
anti-entropy, as `p2p-diloco join` runs them) on the in-memory network and fake clock. Its real-process
twin, `tests/integration/test_insider_union.py`, proves the wiring (real `join` processes, the DHT,
`status`); this one checks every event, which only virtual time allows.

The **insider** is the first peer to take the synchronizer role (every peer may synchronize: a listed
key). In every term it holds, each union round it publishes lists the learners' genuine signed deltas but
claims, by its checksum, a result that is not their merge: the honest merge plus 0.2 on every weight of the
fragment, a state it installs on its own replica and serves to anyone who asks (snapshots, its update log,
heartbeat tips). A replica merges the listed deltas itself, so the forgery shows as a checksum that does
not match; before issue #41 that mismatch vouched for the claimed state and the replica then refetched it
from the forger: every replica adopted every forged state.

Asserted: every honest replica refused a forged record with `merge mismatch`, counted against the insider
only; no honest replica ever held a forged state (checked after every event, not only at the end); the
run went on: honest holders took later terms and their updates applied (versions beyond the forger's
first, replicas equal among the honest peers, the eval loss fell).
"""

from __future__ import annotations

import dataclasses

import pytest

from p2p_diloco.protocol.checksum import fragment_checksum
from p2p_diloco.protocol.messages import UpdateTag
from p2p_diloco.swarm.inprocess import InProcessSwarm, SwarmSpec
from p2p_diloco.swarm.peer import Peer

pytestmark = pytest.mark.sim

FILL = 0.2  # what the forged result adds to every weight of the fragment


class InsiderSwarm(InProcessSwarm):
    """The first peer to hold a term forges every union round it closes (module docstring); `forged`
    holds (fragment, version, checksum) of each claimed state, `adopted` any honest peer that held one."""

    def __init__(self, spec: SwarmSpec, corpus):  # noqa: ANN001
        super().__init__(spec, corpus=corpus)
        self.insider: str | None = None
        self.forged: set[tuple[int, int, str]] = set()
        self.adopted: set[tuple[str, int, int]] = set()

    def _start_peer(self, i: int, replica, incarnation: int) -> Peer:  # noqa: ANN001
        peer = super()._start_peer(i, replica, incarnation)
        take = peer.role.take

        def take_and_forge(term: int) -> None:
            take(term)
            if self.insider in (None, peer.peer_id):
                self.insider = peer.peer_id
                self._forge_merges(peer)

        peer.role.take = take_and_forge
        handle = peer.handle

        def handle_and_check(event):  # noqa: ANN001, ANN202
            out = handle(event)
            self._check_honest(peer)
            return out

        peer.handle = handle_and_check
        return peer

    def _forge_merges(self, peer: Peer) -> None:
        merger = peer.role.sync.merger
        honest = merger.merge_union

        def forged(p, contributions, *, live, term):  # noqa: ANN001, ANN202
            record, pending, grad = honest(p, contributions, live=live, term=term)
            params = {name: t + FILL for name, t in pending.params.items()}
            checksum = fragment_checksum(self.plan.names(p), params, pending.momentum, pending.to_version)
            self.forged.add((p, pending.to_version, checksum))
            pending = dataclasses.replace(pending, params=params, checksum=checksum)
            return dataclasses.replace(record, checksum=checksum), pending, grad

        merger.merge_union = forged

    def _check_honest(self, peer: Peer) -> None:
        if peer.peer_id == self.insider:
            return
        for p in range(self.plan.num_fragments):
            version = peer.replica.version(p)
            if (p, version, peer.replica.checksum(p)) in self.forged:
                self.adopted.add((peer.peer_id, p, version))


def test_every_replica_refuses_an_insiders_forged_union_merge_and_the_run_goes_on(manifest, corpus):
    union = dataclasses.replace(
        manifest,
        wire=dataclasses.replace(manifest.wire, codec="topk4k-int2", density=0.03),
        timing=dataclasses.replace(manifest.timing, term_rounds=6),  # terms rotate: honest holders follow
    )
    swarm = InsiderSwarm(SwarmSpec(manifest=union, learners=3, duration=60.0, eval_every=60), corpus)
    report = swarm.run()
    insider = swarm.insider
    assert insider is not None and swarm.forged, "the insider never published"
    assert not swarm.adopted, f"honest replicas held forged states: {sorted(swarm.adopted)}"
    honest = [peer for peer in swarm.peers.values() if peer.peer_id != insider]
    for peer in honest:
        assert peer.rejections[UpdateTag.MERGE_MISMATCH] >= 1, (peer.peer_id, peer.rejections)
        senders = {who for who, tag in peer.rejections_by_sender if tag == UpdateTag.MERGE_MISMATCH}
        assert senders == {insider}, senders
        assert insider in peer.book.vouchers.caught
    # the run went on: an honest holder took a later term, its updates applied on every honest replica
    # (no forged state was ever held, so every version held is honest work), the insider's replica was
    # and the model trained; honest replicas at the same version of a fragment hold the same state
    assert any(holder != insider for _, holder, _ in report.terms), report.terms
    assert all(min(peer.replica.versions()) >= 1 for peer in honest), [p.replica.versions() for p in honest]
    for p in range(swarm.plan.num_fragments):
        states = {(peer.replica.version(p), peer.replica.checksum(p)) for peer in honest}
        assert len(states) == len({version for version, _ in states}), (p, states)
    assert report.final_eval_loss < report.eval_curve[0][2], report.eval_curve
