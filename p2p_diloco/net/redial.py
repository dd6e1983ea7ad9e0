"""Peers re-dial their bootstrap nodes: a restarted bootstrap node learns the swarm from both sides.

A bootstrap node that restarts comes back with an empty routing table; the peers it served still know
its address, but hivemind only dials it again when a lookup happens to need it. `Redialer` checks, at
most once per period, whether this peer is connected to each of its bootstrap nodes (the run's manifest
``bootstrap`` addresses or ``--initial-peers``) and pings one that is not, with a bounded exponential
backoff per node (`FIRST_BACKOFF` doubling up to `MAX_BACKOFF`, reset once it is connected again).
The ping makes the bootstrap node add this peer to its routing table, so ``status`` and a newcomer
through it see the swarm again.

Only hivemind's public API is used: `DHT.run_coroutine` runs `_check_and_ping` in the DHT process,
where it lists the connected peers (`P2P.list_peers`) and pings with `DHTProtocol.call_ping`, what
hivemind itself uses to bootstrap. The call returns a future: the caller's thread never waits on the DHT.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from hivemind.p2p import PeerID

from p2p_diloco.errors import ConfigError
from p2p_diloco.net.addresses import parse_peer_address, peer_id_in

log = logging.getLogger(__name__)

FIRST_BACKOFF = 1.0
MAX_BACKOFF = 30.0
HEALTHY_PERIOD = 2.0  # how often a connected bootstrap node is checked again


async def _check_and_ping(peer_ids: Sequence[str], _dht: Any, node: Any) -> dict[str, bool]:
    """In the DHT process: for each peer, whether it is connected now (pinging the ones that are not)."""
    connected = {str(info.peer_id) for info in await node.p2p.list_peers()}
    out: dict[str, bool] = {}
    for peer in peer_ids:
        if peer in connected:
            out[peer] = True
            continue
        answered = await node.protocol.call_ping(PeerID.from_base58(peer), validate=False, strict=False)
        out[peer] = answered is not None
    return out


@dataclass
class _Backoff:
    next_at: float = 0.0
    delay: float = FIRST_BACKOFF
    down_since: float | None = None


class Redialer:
    def __init__(self, dht: Any, bootstrap: Sequence[str], own_peer_id: str):
        self.dht = dht
        ids = []
        for address in bootstrap:
            try:
                peer = peer_id_in(parse_peer_address(address, what="bootstrap address"))
            except ConfigError:
                continue
            if peer and peer != own_peer_id and peer not in ids:
                ids.append(peer)
        self.state = {peer: _Backoff() for peer in ids}
        self._pending: Any = None  # the future of the call in flight, with the peers it asked about
        self._asked: list[str] = []
        self.redials = 0  # pings of a bootstrap node found disconnected that it answered

    def tick(self, now: float) -> None:
        """Collect the last check's answer; start the next one for the nodes that are due."""
        if self._pending is not None:
            if not self._pending.done():
                return
            try:
                found = self._pending.result()
            except Exception as exc:  # noqa: BLE001 - a failed check is a failed dial: back off
                log.debug("bootstrap re-dial failed: %r", exc)
                found = dict.fromkeys(self._asked, False)
            self._pending = None
            for peer, up in found.items():
                self._note(peer, up, now)
        due = [peer for peer, b in self.state.items() if now >= b.next_at]
        if due:
            self._asked = due
            self._pending = self.dht.run_coroutine(partial(_check_and_ping, due), return_future=True)

    def _note(self, peer: str, up: bool, now: float) -> None:
        b = self.state[peer]
        if up:
            if b.down_since is not None:
                self.redials += 1
                log.info("bootstrap node %s is reachable again", peer)
            self.state[peer] = _Backoff(next_at=now + HEALTHY_PERIOD)
            return
        b.down_since = now if b.down_since is None else b.down_since
        b.next_at = now + b.delay
        b.delay = min(MAX_BACKOFF, b.delay * 2)
