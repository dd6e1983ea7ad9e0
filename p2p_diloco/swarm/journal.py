"""A peer's journal and context.

`Journal`: the decision lines a peer logs and the rejections it counts, per tag and sender. Every part of
a peer writes here (`note`, `reject`); each line also goes out as a `Note` intent, so the driver can log
it (events.jsonl, stderr) without the peer doing I/O. `PeerContext`: what every part of a peer is given
(who it is, its run, its fragment plan and replica, its journal and where its intents go), instead of
long argument lists.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from p2p_diloco.config import RunManifest
from p2p_diloco.protocol.fragments import FragmentPlan
from p2p_diloco.protocol.replica import GlobalReplica
from p2p_diloco.swarm.effects import Intent, Note
from p2p_diloco.wire.replies import Reply

DECISIONS_KEPT = 64
# Senders counted one by one; refusals of any further sender count under `OTHER_SENDERS` (a flood of fresh
# keys must not grow a peer's memory)
MAX_SENDERS_COUNTED = 256
OTHER_SENDERS = "<other senders>"


class Journal:
    def __init__(self, peer_id: str, emit: Callable[[Intent], None]):
        self.peer_id = peer_id
        self._emit = emit
        self.rejections: Counter[str] = Counter()
        self.rejections_by_sender: Counter[tuple[str, str]] = Counter()
        self.decisions: deque[str] = deque(maxlen=DECISIONS_KEPT)
        self.notes = 0  # lines noted so far

    def note(self, line: str) -> None:
        self.decisions.append(line)
        self.notes += 1
        self._emit(Note(line))

    def reject(self, sender: str, tag: str, detail: str) -> Reply:
        """Count and log a refused frame or record; the `Reply` the sender gets."""
        self.rejections[tag] += 1
        key = (sender, tag)
        if key not in self.rejections_by_sender and len(self.rejections_by_sender) >= MAX_SENDERS_COUNTED:
            key = (OTHER_SENDERS, tag)
        self.rejections_by_sender[key] += 1
        self.note(f"rejected from {sender}: {tag}: {detail}")
        return Reply.refused(tag, detail)


@dataclass(frozen=True)
class PeerContext:
    """Who a peer is and what its parts share; built once by `Peer`."""

    peer_id: str
    manifest: RunManifest
    plan: FragmentPlan
    replica: GlobalReplica
    journal: Journal
    emit: Callable[[Intent], None]
