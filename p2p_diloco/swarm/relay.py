"""Updates spread peer to peer: who gets an update from whom, as pure bookkeeping (time passed in).

The publisher pushes each update to at most `[diloco] fanout` peers; every peer that checked and applied
it (pushed or relayed, never replayed nor unchecked) offers it onward to at most `fanout` peers. Who
offers to whom is a tree over one order of the live peers per update: the leader first, then the others
in the order of a hash ring (each peer at the hash of its ID) read from the hash of the update onward, so
every peer with the same view of the live peers computes the same tree, and different updates start at
different peers (no peer relays every update). The ring is sorted once per change of the live peers
(`Ring`), so an update costs no hash per peer and no sort (issue #40: M hashes and a sort per applied
update were most of what relaying cost a peer at 256); where every member is proven (a run that lists
nobody) a peer's children are found by arithmetic on the ring (`Ring.children_of`), with no list of the M
members built per update. Peers with
signed evidence of taking part come before all others (`proven`): those the manifest lists, the
contributors the update's own signed record names, and those of the last `RECENT_RECORDS` records applied
here. A fresh key's heartbeat thus gets it a place only below every proven peer: it can delay no proven
peer's update by sitting near the root and keeping it (in a run open to any learner, keys cost nothing,
while a place among the proven costs a delta a synchronizer merged and signed). The peer at
position i offers to positions i*f+1 .. i*f+f: an update reaches M peers in about log_f(M) hops, and each
peer sends at most f payloads and receives one. A child that an offer does not reach (gone, unreachable)
has its children offered the update by its parent instead (`heirs`, one level).

Offers are small (`wire.relay_frames.Offer`); the payload follows only when the receiver asks (`SEND`):
it declines an update it holds (`HAVE`), one it already asked another peer for (`ASKED`, until
`ASK_SECONDS` pass without the payload), and every offer of a relayer that sent garbage (`DROPPED`).
Views of the live peers differ a little between peers; an offer to a peer that has the update costs a
few bytes, and a peer that no one offered to catches up from heartbeats' trusted tips (`swarm.repair`).

Relaying extends no trust: the receiver checks a relayed record in full (`UpdateBook.accept`), and a
relayer whose record fails a check that its own checks must have passed is counted and dropped.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_left
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Collection, Container, Iterable
from dataclasses import dataclass, field

from p2p_diloco.config import RunManifest
from p2p_diloco.protocol.decisions import AdmissionTag
from p2p_diloco.protocol.messages import UpdateTag
from p2p_diloco.wire.relay_frames import RelayTag, UpdateId
from p2p_diloco.wire.replies import Reply, ReplyStatus

ASK_SECONDS = 10.0  # how long a receiver waits for a payload it asked for before it asks another offerer
MAX_TRACKED = 256  # updates remembered (asked for, or known held by their offerers); oldest dropped first
MAX_DROPPED = 256  # relayers dropped for garbage, remembered
RECENT_RECORDS = 32  # applied records whose contributors rank as proven in later updates' trees

# Refusals of a relayed record that its relayer's own checks must have made: relaying it is an offence.
# (A duplicate, a gap, a checksum that does not match my state or a lease that lapsed on the way are not.)
OFFENCES = frozenset(
    {
        RelayTag.MISMATCH,
        RelayTag.BAD_FRAME,
        UpdateTag.BAD_SIGNATURE,
        UpdateTag.NO_LEASE,
        UpdateTag.WRONG_CODEC,
        UpdateTag.NOT_FINITE,
        UpdateTag.TOO_LARGE,
        UpdateTag.UNKNOWN_CONTRIBUTOR,
        UpdateTag.IMPLAUSIBLE_WEIGHT,
        AdmissionTag.WRONG_RUN,
        AdmissionTag.WRONG_MANIFEST,
        AdmissionTag.UNKNOWN_FRAGMENT,
    }
)


def point(text: str) -> bytes:
    """A place on the ring (16 bytes of BLAKE2b)."""
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def update_point(update: UpdateId) -> bytes:
    """Where `update`'s walk round the ring starts."""
    return point(f"{update.fragment}:{update.from_version}:{update.term}:{update.checksum}")


class Ring:
    """The peers of a tree sorted once by `point(peer)`; `order` reads them from an update's point on."""

    def __init__(self, peers: Iterable[str]):
        placed = sorted((point(peer), peer) for peer in set(peers))
        self.points = [at for at, _ in placed]
        self.peers = [peer for _, peer in placed]
        self.members = frozenset(self.peers)
        self.place = {peer: i for i, peer in enumerate(self.peers)}

    def children_of(self, update: UpdateId, peer: str, fanout: int, proven: Container[str] = ()) -> list[str]:
        """`children_in(self.order(update, proven), peer, fanout)`; [] for a peer not in the order. With
        every member proven, found by arithmetic on the ring: no list of the M members per update."""
        if proven is not self.members:
            order = self.order(update, proven)
            return children_in(order, peer, fanout) if peer in order else []
        walk = _Walk(self, update)
        at = walk.position(peer)
        if at is None:
            return []
        first = at * fanout + 1
        return [walk.at(i) for i in range(first, min(first + fanout, walk.length))]

    def order(self, update: UpdateId, proven: Container[str] = ()) -> list[str]:
        """The tree order of `update`: its leader first, then the `proven` peers, then the others, each
        group round the ring from `update_point(update)`."""
        start = bisect_left(self.points, update_point(update))
        walk = self.peers[start:] + self.peers[:start]
        leader = update.leader
        if proven is self.members:  # everyone proven (a run that lists nobody): one group, sliced in C
            if leader in self.members:
                walk.remove(leader)
            return [leader, *walk]
        first = [p for p in walk if p in proven and p != leader]
        rest = [p for p in walk if p not in proven and p != leader]
        return [leader, *first, *rest]


class _Walk:
    """`Ring.order(update, ring.members)` as arithmetic: position 0 the leader, then the ring from
    `update_point(update)` on, less the leader."""

    def __init__(self, ring: Ring, update: UpdateId):
        self.ring, self.leader, self.n = ring, update.leader, len(ring.peers)
        self.start = bisect_left(ring.points, update_point(update)) % self.n if self.n else 0
        self.skip = self._step(ring.place[self.leader]) if self.leader in ring.place else None
        self.length = self.n + (0 if self.skip is not None else 1)

    def _step(self, place: int) -> int:
        """How far round the ring from the start `place` is."""
        return (place - self.start) % self.n

    def position(self, peer: str) -> int | None:
        if peer == self.leader:
            return 0
        place = self.ring.place.get(peer)
        if place is None:
            return None
        step = self._step(place)
        return step + (0 if self.skip is not None and self.skip < step else 1)

    def at(self, position: int) -> str:
        """The peer at `position` (1 <= position < length)."""
        step = position - 1
        if self.skip is not None and step >= self.skip:
            step += 1
        return self.ring.peers[(self.start + step) % self.n]


def children_in(order: list[str], me: str, fanout: int) -> list[str]:
    """`me`'s children in a tree `order`: positions i*f+1 .. i*f+f for `me` at position i."""
    i = order.index(me)
    return order[i * fanout + 1 : (i + 1) * fanout + 1]


def relay_order(update: UpdateId, peers: Collection[str], proven: Collection[str] = ()) -> list[str]:
    """The tree order of `update` over `peers` (`Ring.order`)."""
    return Ring(peers).order(update, frozenset(proven))


def children(
    update: UpdateId, peers: Collection[str], me: str, fanout: int, proven: Collection[str] = ()
) -> list[str]:
    """The peers `me` offers `update` to: its children in the tree over `peers` plus `me`."""
    return children_in(relay_order(update, {*peers, me}, proven), me, fanout)


@dataclass
class RelayStats:
    """Per-peer counters of spreading updates (`status`'s `relay` section; scripts/bench_swarm.py)."""

    update_bytes_sent: int = 0  # update frames sent: pushed as publisher and relayed
    update_frames_sent: int = 0
    published: int = 0  # updates this peer published as synchronizer
    publish_pushes: int = 0  # frames pushed as publisher (at most fanout per update)
    relayed: int = 0  # payloads sent as a relayer (each asked for by its receiver)
    offers_sent: int = 0
    offers_declined: int = 0  # offers answered HAVE, ASKED or DROPPED (nothing more sent)
    heirs_offered: int = 0  # offers to the children of a peer my offer did not reach
    offers_received: int = 0
    asked: int = 0  # offers answered SEND
    applied_relayed: int = 0  # updates applied from a relayer
    applied_pushed: int = 0  # updates applied from the publisher's push
    offences: int = 0  # relayed records refused for what the relayer's checks must have refused
    max_hop: int = 0  # the most hops an update applied here had travelled
    hops: dict[int, int] = field(default_factory=dict)  # fragment -> hops of its newest applied update
    applied_at: dict[int, tuple[int, float]] = field(default_factory=dict)  # fragment -> (version, time)

    def as_dict(self) -> dict[str, object]:
        fields = {k: v for k, v in vars(self).items() if k not in ("hops", "applied_at")}
        fields["hops"] = {str(p): h for p, h in sorted(self.hops.items())}
        fields["applied_at"] = {str(p): [v, round(t, 3)] for p, (v, t) in sorted(self.applied_at.items())}
        return fields


@dataclass(frozen=True)
class Asked:
    peer: str
    hop: int
    until: float


class Relay:
    def __init__(
        self,
        peer_id: str,
        fanout: int,
        *,
        ask_seconds: float = ASK_SECONDS,
        member: Callable[[str], bool] = lambda peer: True,
        listed: Callable[[str], bool] = lambda peer: True,
    ):
        if fanout < 1:
            raise ValueError(f"fanout must be >= 1, got {fanout}")
        self.peer_id = peer_id
        # Only peers the manifest lets take part are in a tree: unlisted keys' heartbeats must not decide
        # who gets an update first (they could take every place near the root and swallow it).
        self.member = member
        self.listed = listed  # the manifest names it (`RunManifest.listed`): proven without a record
        self._recent: deque[tuple[str, ...]] = deque()  # contributors of the last RECENT_RECORDS applied
        self._named: Counter[str] = Counter()  # how many of those name each peer (kept as they change)
        self._ring: tuple[frozenset[str], Ring, frozenset[str]] | None = None  # (live, its ring, listed)
        self.fanout = fanout
        self.ask_seconds = ask_seconds
        self.stats = RelayStats()
        self._asked: OrderedDict[UpdateId, Asked] = OrderedDict()
        self._holders: OrderedDict[UpdateId, set[str]] = OrderedDict()  # peers that offered it to me
        self.dropped: OrderedDict[str, str] = OrderedDict()  # relayer -> the offence that dropped it

    @classmethod
    def for_run(cls, peer_id: str, manifest: RunManifest) -> Relay:
        """The relay of a peer of the run `manifest` describes: its fanout, who takes part, who is listed."""
        return cls(peer_id, manifest.diloco.fanout, member=manifest.takes_part, listed=manifest.listed)

    # ---- sending -----------------------------------------------------------------------------------

    def _ring_of(self, live: Collection[str]) -> tuple[Ring, frozenset[str]]:
        """The ring of the peers of `live` that take part, and me, with the listed ones among them; built
        again only when `live` changes."""
        key = frozenset(live)
        if self._ring is None or self._ring[0] != key:
            tree = [p for p in key if self.member(p)] + [self.peer_id]
            self._ring = (key, Ring(tree), frozenset(p for p in tree if self.listed(p)))
        return self._ring[1], self._ring[2]

    def _children(
        self, update: UpdateId, live: Collection[str], contributors: Collection[str], peers: Iterable[str]
    ) -> list[list[str]]:
        """The children of each of `peers` in `update`'s tree over the live peers that take part (and me):
        the listed peers, those its signed record names (`contributors`) and those the last records applied
        here name rank as proven."""
        ring, listed = self._ring_of(live)
        if len(listed) == len(ring.members):  # every member listed: all proven, whoever contributed
            proven: Container[str] = ring.members
        else:
            proven = self._proven_of(ring.members, listed, contributors)
        return [ring.children_of(update, peer, self.fanout, proven) for peer in peers]

    def _proven(self, tree: Collection[str], contributors: Collection[str]) -> frozenset[str]:
        """The peers of `tree` with signed evidence of taking part: listed by the manifest, or named as a
        contributor by this update's record (`contributors`) or by one of the last records applied here."""
        members = frozenset(tree)
        return self._proven_of(members, frozenset(p for p in members if self.listed(p)), contributors)

    def _proven_of(
        self, members: frozenset[str], listed: frozenset[str], contributors: Collection[str]
    ) -> frozenset[str]:
        """`_proven` of a tree's `members` whose `listed` ones are known, in set operations: asking for
        each of the M members in turn was a Python call per member per applied update (issue #40)."""
        return listed | (members & frozenset(contributors)) | (self._named.keys() & members)

    def _remember(self, contributors: Collection[str]) -> None:
        named = tuple(set(contributors))
        self._recent.append(named)
        self._named.update(named)
        if len(self._recent) > RECENT_RECORDS:
            for peer in self._recent.popleft():
                self._named[peer] -= 1
                if self._named[peer] <= 0:
                    del self._named[peer]

    def publish(
        self, update: UpdateId, live: Collection[str], frame_bytes: int, contributors: Collection[str] = ()
    ) -> list[str]:
        """The peers the publisher pushes `update` to (at most `fanout`), counted as sent; `contributors`:
        those its signed record names."""
        (targets,) = self._children(update, live, contributors, (self.peer_id,))
        self._remember(contributors)
        self.stats.published += 1
        self.stats.publish_pushes += len(targets)
        self.sent_payloads(len(targets), frame_bytes)
        return targets

    def onward(
        self,
        update: UpdateId,
        live: Collection[str],
        holds: Container[str] = (),
        contributors: Collection[str] = (),
    ) -> list[str]:
        """The peers to offer an update I applied to: my children in its tree, less those known to hold
        it (`holds`: e.g. heartbeats at its version; and the peers that offered it to me)."""
        offered = self._holders.get(update, set())
        (mine,) = self._children(update, live, contributors, (self.peer_id,))
        self._remember(contributors)
        targets = [p for p in mine if p not in holds and p not in offered]
        self.stats.offers_sent += len(targets)
        return targets

    def heirs(
        self,
        update: UpdateId,
        live: Collection[str],
        failed: Collection[str],
        contributors: Collection[str] = (),
    ) -> list[str]:
        """The children of `failed` peers (offers that did not reach them) I offer `update` to instead."""
        known = self._holders.get(update, set()) | {self.peer_id, *failed}
        found = [c for mine in self._children(update, live, contributors, failed) for c in mine]
        heirs = [c for c in dict.fromkeys(found) if c not in known]
        self.stats.offers_sent += len(heirs)
        self.stats.heirs_offered += len(heirs)
        return heirs

    def sent_payloads(self, count: int, frame_bytes: int, *, relayed: bool = False) -> None:
        self.stats.update_frames_sent += count
        self.stats.update_bytes_sent += count * frame_bytes
        if relayed:
            self.stats.relayed += count

    def declined(self, count: int) -> None:
        self.stats.offers_declined += count

    # ---- receiving ---------------------------------------------------------------------------------

    def on_offer(self, sender: str, update: UpdateId, hop: int, version: int, now: float) -> Reply:
        """Ask `sender` for `update` (`SEND`), or say why not; `version` is my replica's of its fragment."""
        self.stats.offers_received += 1
        self._holders.setdefault(update, set()).add(sender)
        _trim(self._holders)
        if sender in self.dropped:
            return Reply.refused(RelayTag.DROPPED, f"{sender} relayed garbage: {self.dropped[sender]}")
        if version >= update.to_version:
            return Reply.refused(RelayTag.HAVE, f"at v{version}")
        asked = self._asked.get(update)
        if asked is not None and asked.until > now and asked.peer != sender:
            return Reply.refused(RelayTag.ASKED, f"{update} asked from {asked.peer}")
        self._asked[update] = Asked(sender, hop, now + self.ask_seconds)
        _trim(self._asked)
        self.stats.asked += 1
        return Reply(ReplyStatus.ACCEPTED, RelayTag.SEND, str(update))

    def expected(self, sender: str, update: UpdateId) -> int | RelayTag:
        """The hop of a relayed `update` if I asked `sender` for it (the entry is used up); else
        `MISMATCH` if I asked `sender` for another update of that fragment and version (an offence),
        `UNASKED` if for none."""
        asked = self._asked.get(update)
        if asked is not None and asked.peer == sender:
            del self._asked[update]
            return asked.hop
        for other, asked in self._asked.items():
            if asked.peer == sender and (other.fragment, other.from_version) == (
                update.fragment,
                update.from_version,
            ):
                return RelayTag.MISMATCH
        return RelayTag.UNASKED

    def refused(self, sender: str, tag: str) -> bool:
        """A relayed record from `sender` was refused with `tag`: an offence drops it (True)."""
        if tag not in OFFENCES:
            return False
        self.stats.offences += 1
        self.dropped.pop(sender, None)
        self.dropped[sender] = str(tag)
        while len(self.dropped) > MAX_DROPPED:
            self.dropped.popitem(last=False)
        for update in [u for u, asked in self._asked.items() if asked.peer == sender]:
            del self._asked[update]
        return True

    def applied(self, update: UpdateId, hop: int, now: float, *, relayed: bool) -> None:
        """An update pushed (hop 1) or relayed to me was applied at `now`."""
        stats = self.stats
        if relayed:
            stats.applied_relayed += 1
        else:
            stats.applied_pushed += 1
        stats.max_hop = max(stats.max_hop, hop)
        stats.hops[update.fragment] = hop
        stats.applied_at[update.fragment] = (update.to_version, now)


def _trim(table: OrderedDict) -> None:
    while len(table) > MAX_TRACKED:
        table.popitem(last=False)
