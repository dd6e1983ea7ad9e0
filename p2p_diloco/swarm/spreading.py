"""Relaying on a peer: offers of updates in and out, and relayed updates checked, applied and passed on.

`swarm.relay.Relay` decides (whom to offer an update to, whether to ask for an offered one, who is
dropped); `Spreading` turns its decisions into intents (`OfferUpdate` tasks, `RelayUpdate` sends) on
the peer's owner thread. A relayed update goes through `UpdateBook.accept` like a pushed one (every
check; only the pusher need not be its leader), and only an applied update is offered onward.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from p2p_diloco.errors import DecodeError
from p2p_diloco.protocol.decisions import AdmissionTag
from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.swarm import effects as fx
from p2p_diloco.swarm.election.membership import Membership
from p2p_diloco.swarm.journal import PeerContext
from p2p_diloco.swarm.outbox import Outbox
from p2p_diloco.swarm.relay import Relay
from p2p_diloco.swarm.updates import UpdateBook, UpdateSource
from p2p_diloco.wire.frames import decode_update, encode_update
from p2p_diloco.wire.records import HeartbeatInfo
from p2p_diloco.wire.relay_frames import (
    Offer,
    Relayed,
    RelayTag,
    UpdateId,
    decode_relay,
    encode_offer,
    encode_relayed,
)
from p2p_diloco.wire.replies import Reply, ReplyStatus


class Spreading:
    def __init__(
        self,
        ctx: PeerContext,
        book: UpdateBook,
        membership: Membership,
        outbox: Outbox,
        relay: Relay,
        spawn: Callable[..., None],
        repair: Callable[[fx.RepairNeeded], None],
        witness: Callable[[UpdateRecord], None] = lambda record: None,
    ):
        """`witness`: told of every relayed record that decodes, applied or not (`UnderwayGate.witness`: a
        fresh peer whose reads find nobody learns from it that the run is under way)."""
        self.manifest, self.plan, self.replica = ctx.manifest, ctx.plan, ctx.replica
        self.journal, self._emit = ctx.journal, ctx.emit
        self.book, self.membership, self.outbox, self.relay = book, membership, outbox, relay
        self.spawn, self._repair, self._witness = spawn, repair, witness

    def receive(self, sender: str, data: bytes, now: float) -> fx.Task:
        """An offer (answered at once: send it, or why not), or an update I asked `sender` for: checked
        in full as a pushed one is (`UpdateBook.accept`), applied, then offered onward."""
        if not self.membership.allowed(sender):
            return self.journal.reject(
                sender, AdmissionTag.NOT_ALLOWED, "sender is not in the run's allowlist"
            )
        try:
            message = decode_relay(data)
            if isinstance(message, Relayed):
                record = decode_update(message.frame, max_bytes=self.manifest.wire.max_message_bytes)
        except DecodeError as exc:
            self._relay_offence(sender, RelayTag.BAD_FRAME)
            return self.journal.reject(sender, exc.reason, f"relay frame: {exc.detail}")
        if isinstance(message, Offer):
            update = message.update
            if not 0 <= update.fragment < self.plan.num_fragments:
                detail = f"offered fragment {update.fragment} not in [0, {self.plan.num_fragments})"
                return self.journal.reject(sender, AdmissionTag.UNKNOWN_FRAGMENT, detail)
            return self.relay.on_offer(
                sender, update, message.hop, self.replica.version(update.fragment), now
            )
        update = UpdateId.of(record)
        hop = self.relay.expected(sender, update)
        if not isinstance(hop, int):
            self._relay_offence(sender, hop)
            return self.journal.reject(sender, hop, f"relayed {update}")
        verdict = yield from self.book.accept(message.frame, sender, UpdateSource.RELAYED, now, record)
        if verdict.record is not None:
            self._witness(verdict.record)
        if verdict.reply.status == ReplyStatus.APPLIED:
            self.spread(record, hop=hop, now=now, relayed=True)
        else:
            self._relay_offence(sender, verdict.reply.tag)
            if verdict.repair is not None:
                self._repair(verdict.repair)
        return verdict.reply

    def _relay_offence(self, sender: str, tag: str) -> None:
        if self.relay.refused(sender, tag):
            self.journal.note(f"dropped relayer {sender}: it relayed a record refused for {tag}")

    def spread(self, record: UpdateRecord, *, hop: int, now: float, relayed: bool) -> None:
        """An update pushed or relayed to me was applied: offer it to my children in its relay tree."""
        update = UpdateId.of(record)
        self.relay.applied(update, hop, now, relayed=relayed)
        live = self.membership.live_peers
        holds = _HeldBy(live, record.fragment, update.to_version)
        targets = self.relay.onward(update, live, holds, contributors=record.contributor_ids)
        if targets:
            self.spawn(self._offer(record, hop + 1, tuple(targets)))

    def _offer(self, record: UpdateRecord, hop: int, targets: tuple[str, ...]) -> fx.Task:
        """Offer `record` to `targets`, send it to those that ask; a target the offer did not reach hands
        its children to me (one level: I send at most fanout x (fanout + 1) payloads of an update)."""
        update = UpdateId.of(record)
        replies = yield fx.OfferUpdate(targets, encode_offer(Offer(update, hop)))
        wanted, failed = _sorted_replies(targets, replies)
        live = self.membership.live_peers
        heirs = tuple(self.relay.heirs(update, live, failed, record.contributor_ids)) if failed else ()
        if heirs:
            replies = yield fx.OfferUpdate(heirs, encode_offer(Offer(update, hop + 1)))
            wanted += _sorted_replies(heirs, replies)[0]
        self.relay.declined(len(targets) + len(heirs) - len(wanted))
        if wanted:
            # encoded anew, not passed on as received: a header a relayer padded (whitespace, long number
            # text; the signature covers the fields, not the bytes) would travel the whole subtree
            frame = encode_relayed(hop, encode_update(record))
            self.relay.sent_payloads(len(wanted), len(frame), relayed=True)
            for peer in wanted:
                self._emit(fx.RelayUpdate(peer, frame))


class _HeldBy:
    """The live peers whose last heartbeat shows `fragment` at `version` or later, asked peer by peer (a
    relayer asks only about its children: no pass over every live peer per update)."""

    def __init__(self, live: Mapping[str, HeartbeatInfo], fragment: int, version: int):
        self.live, self.fragment, self.version = live, fragment, version

    def __contains__(self, peer: object) -> bool:
        info = self.live.get(peer) if isinstance(peer, str) else None
        if info is None or self.fragment >= len(info.versions):
            return False
        return info.versions[self.fragment] >= self.version


def _sorted_replies(targets: tuple[str, ...], replies: list) -> tuple[list[str], list[str]]:
    """(the targets that asked for the update, those the offer did not reach)."""
    wanted, failed = [], []
    for peer, reply in zip(targets, replies):
        if not isinstance(reply, Reply) or reply.status == ReplyStatus.TRANSIENT:
            failed.append(peer)
        elif reply.status == ReplyStatus.ACCEPTED and reply.tag == RelayTag.SEND:
            wanted.append(peer)
    return wanted, failed
