"""Sim tier: the gather set of union rounds (issue #40) on whole peers of the in-process swarm. Five learners
send sparse deltas to rounds that list at most `gather = 2`: a round offered more lists exactly two, every
replica merges the same deltas (bit-identical replicas), and a learner whose delta was left out gets the
`not gathered` refusal and sends that work again in a later delta, which a later round merges."""

from __future__ import annotations

import dataclasses

import pytest

from p2p_diloco.protocol.gather import GatherTag
from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.swarm import effects as fx
from p2p_diloco.swarm.inprocess import InProcessSwarm, SwarmSpec
from p2p_diloco.wire.delta_bundle import decode_bundle
from p2p_diloco.wire.frames import decode_delta

pytestmark = pytest.mark.sim

GATHER = 2


class RecordingSwarm(InProcessSwarm):
    """Keeps every update a holder published, and every gather refusal a peer's outbox noted."""

    def __init__(self, spec: SwarmSpec, corpus):  # noqa: ANN001
        super().__init__(spec, corpus=corpus)
        self.records: list[UpdateRecord] = []
        self.refusals: list[tuple[str, str]] = []  # (peer, journal line)

    def _observe(self, i: int, intent: fx.Intent) -> None:
        super()._observe(i, intent)
        if isinstance(intent, fx.Published):
            self.records.append(intent.record)
        elif isinstance(intent, fx.Note) and GatherTag.NOT_GATHERED in intent.line and i in self.peers:
            self.refusals.append((self.peers[i].peer_id, intent.line))


def carried_since(record: UpdateRecord, learner: str) -> int:
    """The oldest of `learner`'s delta seqs whose work its delta listed in `record` carries."""
    for listed, frame in zip(record.deltas, decode_bundle(record.payload, max_bytes=1 << 30)):
        if listed.learner == learner:
            return decode_delta(frame, max_bytes=1 << 30)[0].carries_since
    raise AssertionError(f"{learner} is not listed")


def test_a_union_round_lists_gather_deltas_and_the_left_out_send_their_work_again(manifest, corpus):
    sparse = dataclasses.replace(
        manifest,
        diloco=dataclasses.replace(manifest.diloco, gather=GATHER),
        wire=dataclasses.replace(manifest.wire, codec="topk4k-int2", density=0.03),
    )
    swarm = RecordingSwarm(SwarmSpec(manifest=sparse, learners=5, duration=60.0, eval_every=60), corpus)
    report = swarm.run()
    assert report.digests_equal  # every replica merged the same deltas, bit for bit
    assert min(report.versions) >= 4, report.versions  # every fragment moved on
    assert all(len(r.deltas) <= GATHER for r in swarm.records)
    gathered = [r for r in swarm.records if r.left_out]
    assert gathered, "no round was offered more than gather deltas"
    for record in gathered:
        assert len(record.deltas) == GATHER  # offered more than gather: lists exactly gather
        assert not {who for who, _ in record.left_out} & {d.learner for d in record.deltas}
    # every left-out learner was told (the outbox's refusal path) and its work went out again and merged
    assert {peer for peer, _ in swarm.refusals} == {who for r in gathered for who, _ in r.left_out}
    last = {p: max(r.from_version for r in swarm.records if r.fragment == p) for p in range(4)}
    for record in gathered:
        for who, seq in record.left_out:
            later = [
                r
                for r in swarm.records
                if r.fragment == record.fragment
                and r.from_version > record.from_version
                and any(d.learner == who for d in r.deltas)
            ]
            # the gather set rotates (longest wait first): left-out work is merged within a few rounds
            assert later or record.from_version > last[record.fragment] - 3, (record.fragment, who, seq)
            if later:  # the later delta carries the left-out one's work: its since_seq goes back to it
                assert carried_since(later[0], who) <= seq < later[0].seq_of(who), (who, seq)
    assert report.rejections == {}  # left out is no offence
