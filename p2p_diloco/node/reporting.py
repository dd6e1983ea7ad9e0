"""What a node tells the swarm and its operator about itself: contributions, rejections, snapshots.

`Telemetry` (owned by the peer's owner thread, where all its methods run) keeps when this peer's work
last reached the global model, and builds from the `Peer`, the training thread's `TrainingView` and
the transport's `TransportCounts` (both immutable snapshots) the status fields of its heartbeat
(`HeartbeatInfo`: tokens/s, rejection counters by reason and by sender, last decisions; what
`p2p-diloco status` shows), the progress line `join` prints, and `NodeSnapshot`s: everything the
operator sees at one moment, frozen (the live display and the Prometheus metrics both render them).

`ProgressDisplay` prints progress lines (stdout not a terminal); `LiveProgressDisplay` redraws a rich
panel in place instead (stdout a terminal), with other lines printed above it.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, TextIO

from p2p_diloco.net.traffic import TransportCounts
from p2p_diloco.node.guard import HandlerSlot
from p2p_diloco.node.threads import DeltaAccepts
from p2p_diloco.node.training import TrainingView
from p2p_diloco.owner import Owner
from p2p_diloco.swarm.peer import Peer
from p2p_diloco.wire.records import MAX_COUNTERS, MAX_DECISIONS, MAX_TEXT


def seconds_since_launch() -> float | None:
    """Wall seconds since this process was started (Linux /proc, 10 ms ticks); None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return round(uptime - int(after_name[19]) / os.sysconf("SC_CLK_TCK"), 2)  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return None


MAX_TAG_CHARS = 64
ROLES = ("learner", "synchronizer", "observer")
LIVE_PERIOD = 1.0  # seconds between redraws of the live display (at most --progress-every)


def _top(counter: Counter, limit: int) -> list:
    return sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]


def _short(text: str, limit: int = MAX_TEXT) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def rejection_counts(
    peer: Peer | None, guard: HandlerSlot | None, counts: TransportCounts | None
) -> Counter[str]:
    """Every rejection this peer answered or dropped, by reason tag (peer, synchronizer, guard, transport);
    on the owner thread (the guard's and the transport's counts are immutable snapshots)."""
    total: Counter[str] = Counter()
    if peer is not None:
        total.update(peer.rejections)
        if peer.sync is not None:
            total.update(peer.sync.rejections)
    if guard is not None:
        total.update(guard.rejections)
    if counts is not None:
        total.update(counts.rejected)
    return total


def rejections_by_sender(peer: Peer) -> Counter[tuple[str, str]]:
    total: Counter[tuple[str, str]] = Counter(peer.rejections_by_sender)
    if peer.sync is not None:
        total.update(peer.sync.rejections_by_sender)
    return total


@dataclass(frozen=True)
class NodeSnapshot:
    """What one node knows about itself and the swarm at one moment (rendered by display and metrics).

    Counters count since this process started, except ``deltas_merged`` and ``ledger``, which come from
    the state directory's contribution ledger and so include earlier runs of the peer.
    """

    peer_id: str
    role: str
    training: bool
    step: int
    tokens: int
    loss: float
    tokens_per_s: float
    holder: str | None
    term: int
    versions: tuple[int, ...]
    digest: str
    live_peers: int
    updates_applied: int
    deltas_sent: int
    deltas_rejected: int
    deltas_merged: int
    failovers_seen: int
    rounds_merged: int
    rejections: dict[str, int] = field(default_factory=dict)
    rejections_by_sender: dict[tuple[str, str], int] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0
    tick_errors: dict[str, int] = field(default_factory=dict)
    ledger: dict[str, dict[str, Any]] = field(default_factory=dict)  # peer -> tokens, weight, share, updates
    deltas_accepted: int = 0  # remote deltas this process accepted as synchronizer
    # (term, DHT time of its first accepted delta, synchronizer shard)
    first_accepts: tuple[tuple[int, float, int], ...] = ()
    waiting: str = (
        ""  # why this peer claims no term (`swarm.election.underway`: a run under way, replica at 0)
    )
    step_time: float = 0.0  # seconds of the last inner step (0 before the first)
    eval_loss: float = math.nan  # the newest global eval loss this peer ran or read (NaN: none yet)

    def event_fields(self) -> dict[str, Any]:
        """What a ``progress`` event adds to the runtime's own counters (``first_accepts``: the demo times
        a new synchronizer's first accepted delta from it; ``digest``: the replica's, with ``versions``)."""
        return {
            "deltas_sent": self.deltas_sent,
            "deltas_merged": self.deltas_merged,
            "rejected": sum(self.rejections.values()),
            "deltas_accepted": self.deltas_accepted,
            "first_accepts": [list(row) for row in self.first_accepts],
            "digest": self.digest,
        }


class Telemetry:
    """When this node's work last reached the global model, and what it reports (module docstring)."""

    def __init__(self, owner: Owner | None = None):
        self.owner = owner or Owner("peer-owner")
        self.last_contribution = 0.0  # DHT time at which an update merging our delta was first seen
        self._steps_merged_seen = 0.0

    def heartbeat_fields(
        self,
        now: float,
        peer: Peer,
        view: TrainingView,
        guard: HandlerSlot | None,
        counts: TransportCounts | None,
    ) -> dict[str, Any]:
        """Keyword arguments for `Peer.heartbeat` (the status fields of `HeartbeatInfo`)."""
        self.owner.check("Telemetry")
        if view.steps_merged > self._steps_merged_seen:
            self._steps_merged_seen = view.steps_merged
            self.last_contribution = now
        rejections = _top(rejection_counts(peer, guard, counts), MAX_COUNTERS)
        by_sender = _top(rejections_by_sender(peer), MAX_COUNTERS)
        return {
            "step_time": view.step_time,
            "tokens_per_s": view.tokens_per_s,
            "tokens": view.tokens,
            "updates_applied": peer.updates_applied,
            "last_contribution": self.last_contribution,
            "rejections": tuple((_short(tag, MAX_TAG_CHARS), n) for tag, n in rejections),
            "rejections_by_sender": tuple(
                (sender, _short(tag, MAX_TAG_CHARS), n) for (sender, tag), n in by_sender
            ),
            "decisions": tuple(_short(line) for line in list(peer.decisions)[-MAX_DECISIONS:]),
        }

    @staticmethod
    def progress_line(
        peer: Peer, view: TrainingView, guard: HandlerSlot | None, counts: TransportCounts | None
    ) -> str:
        versions = ",".join(str(v) for v in peer.replica.versions())
        role = "synchronizer" if peer.sync else "learner"
        rejected = sum(rejection_counts(peer, guard, counts).values())
        return (
            f"step {view.step} loss {view.loss:.3f} tok/s {view.tokens_per_s:.0f} "
            f"role {role} sync {(peer.holder or 'none')[:12]} term {peer.term_seen} versions {versions} "
            f"applied {peer.updates_applied} digest {peer.replica.digest()[:12]} rejected {rejected}"
            + (f" waiting: {peer.underway.waiting}" if peer.underway.waiting else "")
        )

    @staticmethod
    def snapshot(
        peer: Peer,
        view: TrainingView | None,
        guard: HandlerSlot | None,
        counts: TransportCounts | None,
        *,
        accepts: DeltaAccepts | None = None,
        ledger: dict[str, Any] | None = None,
        tick_errors: Counter[str] | None = None,
        eval_loss: float = math.nan,
    ) -> NodeSnapshot:
        """A `NodeSnapshot` (`view` None: a peer without a learner); `ledger` maps peer ID ->
        `ledger.PeerContribution`."""
        ledger_rows = {p: c.as_dict() for p, c in (ledger or {}).items()}
        mine = ledger_rows.get(peer.peer_id, {})
        return NodeSnapshot(
            peer_id=peer.peer_id,
            role="synchronizer" if peer.sync else ("learner" if view else "observer"),
            training=view.training if view else False,
            step=view.step if view else 0,
            tokens=view.tokens if view else 0,
            loss=view.loss if view else math.nan,
            tokens_per_s=view.tokens_per_s if view else 0.0,
            holder=peer.holder,
            term=peer.term_seen,
            versions=peer.replica.versions(),
            digest=peer.replica.digest()[:16],
            live_peers=len(peer.live_peers),
            updates_applied=peer.updates_applied,
            deltas_sent=view.deltas_sent if view else 0,
            deltas_rejected=view.deltas_rejected if view else 0,
            deltas_merged=int(mine.get("updates", 0)),
            failovers_seen=peer.failovers_seen,
            rounds_merged=peer.sync.rounds_done if peer.sync else 0,
            rejections=dict(rejection_counts(peer, guard, counts)),
            rejections_by_sender=dict(rejections_by_sender(peer)),
            bytes_sent=counts.bytes_sent if counts else 0,
            bytes_received=counts.bytes_received if counts else 0,
            tick_errors=dict(tick_errors or {}),
            ledger=ledger_rows,
            deltas_accepted=accepts.count if accepts is not None else 0,
            first_accepts=accepts.first_accepts() if accepts is not None else (),
            waiting=peer.underway.waiting or "",
            step_time=view.step_time if view else 0.0,
            eval_loss=eval_loss,
        )


# ---- what the operator sees ------------------------------------------------------------------------


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def snapshot_rows(s: NodeSnapshot, run_id: str) -> list[tuple[str, str]]:
    """(label, text) rows of the live display."""
    loss = "-" if math.isnan(s.loss) else f"{s.loss:.3f}"
    top = sorted(s.rejections.items(), key=lambda kv: (-kv[1], kv[0]))[:4]
    total_share = sum(row["share"] for row in s.ledger.values()) or 1.0
    contributors = sorted(s.ledger.items(), key=lambda kv: -kv[1]["share"])[:4]
    return [
        ("peer", f"{s.peer_id}  run {run_id}"),
        ("role", f"{s.role}{'' if s.training else ' (training finished, serving)'}"),
        ("step", f"{s.step}   loss {loss}   tok/s {s.tokens_per_s:,.0f}   tokens {s.tokens:,}"),
        *([("global eval", f"loss {s.eval_loss:.4f}")] if not math.isnan(s.eval_loss) else []),
        (
            "synchronizer",
            f"{s.holder or 'none'}   term {s.term}   live peers {s.live_peers}   "
            f"failovers seen {s.failovers_seen}",
        ),
        ("versions", "  ".join(f"{p}:v{v}" for p, v in enumerate(s.versions)) + f"   digest {s.digest}"),
        *([("waiting", s.waiting)] if s.waiting else []),
        (
            "updates",
            # sent and refused count this process; merged comes from the ledger, all runs of this peer
            f"applied {s.updates_applied}   my deltas sent {s.deltas_sent} and refused {s.deltas_rejected} "
            f"since start, merged {s.deltas_merged} in all runs"
            + (f"   rounds merged {s.rounds_merged}" if s.role == "synchronizer" else ""),
        ),
        ("traffic", f"sent {human_bytes(s.bytes_sent)}   received {human_bytes(s.bytes_received)}"),
        (
            "rejections",
            f"{sum(s.rejections.values())}" + (": " + ", ".join(f"{t} {n}" for t, n in top) if top else ""),
        ),
        (
            "contributions",
            ", ".join(
                f"{peer[:12]} {row['share'] / total_share:.0%} ({row['tokens']:,} tok)"
                for peer, row in contributors
            )
            or "none yet",
        ),
    ]


class ProgressDisplay:
    """Plain output: every line printed as is (stdout is a file or a pipe)."""

    live = False

    def __init__(self, out: TextIO):
        self.out = out

    def period(self, progress_every: float) -> float:
        return progress_every

    def say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def show(self, snapshot: NodeSnapshot, line: str) -> None:
        self.say(line)

    def stop(self) -> None:
        pass


class LiveProgressDisplay(ProgressDisplay):
    """A rich panel redrawn in place (stdout is a terminal); `say` lines scroll above it."""

    live = True

    def __init__(self, out: TextIO, run_id: str):
        super().__init__(out)
        from rich.console import Console
        from rich.live import Live

        self.run_id = run_id
        self.console = Console(file=out)
        self._live = Live(
            console=self.console, auto_refresh=False, redirect_stdout=False, redirect_stderr=False
        )
        self._started = False

    def period(self, progress_every: float) -> float:
        return min(progress_every, LIVE_PERIOD)

    def say(self, line: str) -> None:
        self.console.print(line, markup=False, highlight=False)

    def show(self, snapshot: NodeSnapshot, line: str) -> None:
        from rich.panel import Panel
        from rich.table import Table

        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold cyan", no_wrap=True)
        grid.add_column()
        for label, text in snapshot_rows(snapshot, self.run_id):
            grid.add_row(label, text)
        if not self._started:
            self._live.start()
            self._started = True
        self._live.update(Panel(grid, title="p2p-diloco join", expand=False), refresh=True)

    def stop(self) -> None:
        if self._started:
            self._live.stop()
            self._started = False


def make_display(out: TextIO, run_id: str, mode: str = "auto") -> ProgressDisplay:
    """`mode`: "live" (rich panel), "plain" (lines), "auto" (live when `out` is a terminal)."""
    if mode == "auto":
        is_tty = hasattr(out, "isatty") and out.isatty()
        mode = "live" if is_tty and os.environ.get("TERM") != "dumb" else "plain"
    return LiveProgressDisplay(out, run_id) if mode == "live" else ProgressDisplay(out)
