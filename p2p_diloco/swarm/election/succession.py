"""Fast succession, the swarm side: the successor a holder named watches it and takes over when it dies.

Every lease write names the peer ranked first for the next term (`protocol.candidates.named_successor`).
That peer probes the holder's addresses every swarm tick and whenever a delta to it fails
(`effects.Probe`, performed by the driver's transport: plain TCP connects). Only a refused connection
counts: nobody listens there, so the holder's process is gone; it then reads the swarm at once and the
election (`protocol.election.decide`, `TAG_SUCCESSION`) claims the next term without waiting out the
lease. A frozen holder (its kernel still accepts connections) or one behind a lost link is UNKNOWN and is
replaced only after its lease plus the margin, as before; readers accept the early claim only from the
named successor (`protocol.lease_rules`), and term fencing keeps a woken zombie's updates out.
"""

from __future__ import annotations

from collections.abc import Callable

from p2p_diloco.swarm import effects as fx
from p2p_diloco.swarm.election.membership import Membership, SwarmView
from p2p_diloco.swarm.journal import Journal
from p2p_diloco.wire.interfaces import Liveness
from p2p_diloco.wire.replies import LinkTag, ReplyStatus


class HolderWatch:
    """Owned by a `Peer` (its owner thread): `spawn` runs a task, `elect` runs the election on a view."""

    def __init__(
        self,
        peer_id: str,
        membership: Membership,
        journal: Journal,
        spawn: Callable[[fx.Task], None],
        elect: Callable[[SwarmView, float], object],
    ):
        self.peer_id = peer_id
        self.membership = membership
        self.journal = journal
        self._spawn = spawn
        self._elect = elect
        self.probing = False  # a probe is in flight
        self.probes = 0

    def probe_if_successor(self) -> None:
        """Probe the holder this peer follows if its lease names this peer to succeed it."""
        holder = self.membership.successor_of_followed()
        if holder is None or self.probing:
            return
        self.probing = True
        self.probes += 1
        info = self.membership.live_peers.get(holder)
        self._spawn(self._probe(holder, info.addresses if info is not None else ()))

    def on_delta_reply(self, replied: fx.DeltaReplied) -> None:
        """A delta to the synchronizer failed: refused (its process is gone) or otherwise (probe it now)."""
        if replied.holder != self.membership.holder or replied.holder == self.peer_id:
            return
        if replied.reply.tag == LinkTag.PEER_DOWN:
            self.holder_down(replied.holder)
        elif replied.reply.status == ReplyStatus.TRANSIENT:
            self.probe_if_successor()

    def _probe(self, holder: str, addresses: tuple[str, ...]) -> fx.Task:
        try:
            liveness = yield fx.Probe(holder, addresses)
        finally:
            self.probing = False
        if liveness == Liveness.ALIVE:
            self.membership.mark_alive(holder)
        elif liveness == Liveness.DOWN:
            self.holder_down(holder)

    def holder_down(self, holder: str) -> None:
        """The synchronizer's address refused a connection: run the election now, not at the next tick."""
        if holder in self.membership.down:
            return  # already acted on; the next ticks re-read the swarm
        self.membership.mark_down(holder, self.membership.last_read)
        self.journal.note(f"synchronizer {holder} refused a connection: its process is gone")
        self._spawn(self._elect_now(holder))

    def _elect_now(self, holder: str) -> fx.Task:
        records = yield self.membership.read_swarm()
        self.membership.mark_down(holder, records.now)
        self._elect(self.membership.ingest(records), records.now)
