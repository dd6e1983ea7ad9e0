"""A reconcile overtaken by applied updates installs nothing (`Repair.reconcile_fragment`).

A peer whose fragment lost to a winning branch (`reconcile.classify`: diverged) replaces it by a snapshot
of a peer on that branch. While the snapshot download is in flight the peer may apply newer updates of the
fragment; the decision to replace it was taken on the old tip and is stale. The reconcile then gives up,
notes "while reconciling toward" and leaves the replica as the updates left it (versions never go back);
anti-entropy decides again on fresh tips. If the fragment did not move, the snapshot is installed.
This replaces the race that `tests/sim/test_bottle.py` seed 13 once replayed (node-1, fragment 3).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

import torch

from p2p_diloco.protocol import reconcile
from p2p_diloco.protocol.decisions import Action
from p2p_diloco.protocol.messages import UpdateRecord
from tests.support.manifests import tiny_manifest
from tests.support.peers import PeerHarness, StubTransport, make_peer

MANIFEST = tiny_manifest("overtaken")
FRAGMENT = 0
WINNER_TERM, MY_TERM = 1, 2  # the winner carries more updates; mine has the higher term: diverged


class HeldDownload(StubTransport):
    """Serves `source`'s snapshot index and chunks, but holds every answer until `release`: the download
    stays in flight while the test moves the fragment."""

    def __init__(self, source: PeerHarness):
        super().__init__()
        self.source = source
        self.held: list[tuple[concurrent.futures.Future, Callable[[], bytes]]] = []

    def hold(self, serve: Callable[[], bytes]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.held.append((future, serve))
        return future

    def request_snapshot(self, from_peer, fragment):  # noqa: ANN001, ANN201
        return self.hold(lambda: self.source.serve_snapshot("me", fragment))

    def request_chunk(self, from_peer, fragment, chunk, checksum, nbytes):  # noqa: ANN001, ANN201
        return self.hold(lambda: self.source.serve_chunk("me", fragment, chunk, checksum))

    def release(self) -> bool:
        """Answer every request held so far (their answers may ask more); False when none was held."""
        held, self.held = self.held, []
        for future, serve in held:
            future.set_result(serve())
        return bool(held)


def advance(harness: PeerHarness, steps: int, seed: int) -> None:
    """`steps` outer updates of FRAGMENT applied to `harness`'s replica (gradients drawn from `seed`)."""
    replica = harness.replica
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        grad = {n: torch.randn(s, generator=gen) * 0.01 for n, s in replica.shapes(FRAGMENT).items()}
        version = replica.version(FRAGMENT)
        decision = replica.apply(FRAGMENT, version, grad, lr=0.7, momentum=0.9, expected_checksum=None)
        assert decision.action == Action.APPLY


def diverged() -> tuple[PeerHarness, HeldDownload, reconcile.BranchTip]:
    """`me` at t2 v1 on a losing branch, the source at t1 v2 (the winner, vouched for in `me`'s book), and
    the transport that holds `me`'s download of the source's snapshot."""
    source = make_peer(MANIFEST, peer_id="source", learner=False)
    advance(source, 2, seed=1)
    source.peer.serving.offer_snapshots([FRAGMENT])
    transport = HeldDownload(source)
    me = make_peer(MANIFEST, learner=False, transport=transport)
    advance(me, 1, seed=2)
    me.peer.book.tip_terms[FRAGMENT] = MY_TERM
    state = source.replica
    winner = reconcile.BranchTip(WINNER_TERM, state.version(FRAGMENT), state.checksum(FRAGMENT))
    record = UpdateRecord(
        MANIFEST.run_id, MANIFEST.manifest_hash, FRAGMENT, winner.version - 1, WINNER_TERM, "source",
        (("source", 1.0),), state.checksum(FRAGMENT), b"",
    )  # fmt: skip
    assert me.peer.book.vouchers.vouch(record)  # a checked record produced the winner's state
    assert reconcile.classify(me.peer.book.tip(FRAGMENT), winner).action == reconcile.RECONCILE
    return me, transport, winner


def start_reconcile(me: PeerHarness, winner: reconcile.BranchTip) -> concurrent.futures.Future:
    """Spawn `me`'s reconcile of FRAGMENT toward `winner` from the source; its result once it ends."""
    done: concurrent.futures.Future = concurrent.futures.Future()
    me.peer.spawn(me.peer.repair.reconcile_fragment(FRAGMENT, winner, ["source"]), done.set_result)
    for intent in me.peer.flush():
        me.perform(intent)
    return done


def finish(transport: HeldDownload, done: concurrent.futures.Future) -> bool:
    while transport.release():
        pass
    return done.result(timeout=0)


def test_a_fragment_that_moved_during_the_download_is_not_replaced():
    me, transport, winner = diverged()
    done = start_reconcile(me, winner)
    assert transport.held and not done.done()  # the snapshot download is in flight
    advance(me, 2, seed=3)  # meanwhile updates are applied: t2 v1 -> t2 v3
    moved = (me.replica.version(FRAGMENT), me.replica.checksum(FRAGMENT))
    assert moved[0] == 3 > winner.version  # installing the winner's v2 now would go backwards

    assert finish(transport, done) is False
    assert (me.replica.version(FRAGMENT), me.replica.checksum(FRAGMENT)) == moved
    assert any("while reconciling toward" in line for line in me.peer.decisions)
    assert me.peer.repair.reconciliations == []


def test_a_fragment_that_did_not_move_is_replaced_by_the_winners_snapshot():
    me, transport, winner = diverged()
    done = start_reconcile(me, winner)
    assert transport.held and not done.done()

    assert finish(transport, done) is True
    assert (me.replica.version(FRAGMENT), me.replica.checksum(FRAGMENT)[:16]) == winner.state
    assert me.peer.book.tip(FRAGMENT) == winner
    assert not any("while reconciling toward" in line for line in me.peer.decisions)
    assert len(me.peer.repair.reconciliations) == 1
