"""Sim tier: updates spread peer to peer (`swarm.relay`). In a 16-peer swarm with fanout 2, the publisher
pushes each update to 2 peers, every peer applies every update from a push or a relay, no peer sends
more than 2 payloads per update, and no update travels more than log2(16) hops."""

from __future__ import annotations

import dataclasses
import math

import pytest

from p2p_diloco.swarm.inprocess import InProcessSwarm, SwarmSpec

pytestmark = pytest.mark.sim

LEARNERS, FANOUT = 16, 2


def test_every_peer_applies_every_update_and_no_peer_sends_more_than_fanout(manifest, corpus):
    relaying = dataclasses.replace(manifest, diloco=dataclasses.replace(manifest.diloco, fanout=FANOUT))
    swarm = InProcessSwarm(
        SwarmSpec(relaying, learners=LEARNERS, duration=30.0, eval_every=100), corpus=corpus
    )
    report = swarm.run()
    assert report.digests_equal and min(report.versions) >= 2, report.versions
    stats = {peer.peer_id: peer.relay.stats for peer in swarm.peers.values()}
    published = sum(s.published for s in stats.values())
    assert published == sum(report.versions)
    for peer_id, s in stats.items():
        # every update reached every peer by a push or a relay (none needed a catch-up)
        assert s.published + s.applied_pushed + s.applied_relayed == published, (peer_id, s)
        assert s.publish_pushes <= FANOUT * s.published
        assert s.update_frames_sent <= FANOUT * (s.published + s.applied_pushed + s.applied_relayed)
    relayed = sum(s.relayed for s in stats.values())
    assert relayed == sum(s.applied_relayed for s in stats.values()) > 0
    depth = math.ceil(math.log(LEARNERS * (FANOUT - 1) + 1, FANOUT)) - 1
    assert max(s.max_hop for s in stats.values()) == depth
