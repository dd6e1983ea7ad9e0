"""The dashboard's view of a run: what it reads from the DHT every poll, and the time series it keeps.

`Collector.poll(kv, now)` reads the heartbeats and leases (through `node.status.swarm_status`, what
`p2p-diloco status` prints), every peer's stats record and every evaluator's eval history, and folds
them into `view()`: the JSON the page and scripts read. Things the DHT only knows *now* (fragment
versions, the synchronizer and its term, the live peers' summed tokens/s and mean training loss) are kept
as a bounded time series here, with a mark at each change of synchronizer (``failover`` when the old lease
was not released, ``rotation`` when it was). While no peer is live the versions and the term keep their
last known values (each sample says how many peers were live), rather than dropping to 0.
The eval history is merged into the collector's own copy, so the curve stays on the page even while
no evaluator's record can be read. Records that fail their schema check are counted, never shown.
"""

from __future__ import annotations

import math
import threading
from collections import Counter, deque
from typing import Any

from p2p_diloco.config import RunManifest
from p2p_diloco.node.status import eval_histories, every_heartbeat, swarm_status
from p2p_diloco.wire.interfaces import KeyValueStore, StoredValue
from p2p_diloco.wire.keys import stats_key
from p2p_diloco.wire.observe import EvalHistory, EvalPoint, decode_peer_stats, merge_points, merge_records
from p2p_diloco.wire.records import RecordError, decode_heartbeat

MAX_SAMPLES = 3600  # versions/terms samples kept (2 h at the default 2 s poll)
MAX_MARKS = 200
MAX_ADDRESSES = 64


class _OnePoll:
    """A `KeyValueStore` that reads each key at most once per poll (the status and the collector share)."""

    def __init__(self, kv: KeyValueStore):
        self.kv = kv
        self.cache: dict[str, dict[str, StoredValue]] = {}

    def store(self, key: str, subkey: str, value: bytes, expiration: float) -> bool:
        raise PermissionError("the dashboard is read-only")

    def get(self, key: str, now: float) -> dict[str, StoredValue]:
        if key not in self.cache:
            self.cache[key] = self.kv.get(key, now)
        return self.cache[key]


class Collector:
    """Everything the dashboard shows (module docstring). Thread-safe: `poll` on the poller thread,
    `view` on the HTTP threads."""

    def __init__(self, manifest: RunManifest):
        self.manifest = manifest
        self.fragments = manifest.diloco.fragments
        self._lock = threading.Lock()
        self.status: dict[str, Any] | None = None
        self.samples: deque[dict[str, Any]] = deque(maxlen=MAX_SAMPLES)
        self.marks: deque[dict[str, Any]] = deque(maxlen=MAX_MARKS)
        self.history: tuple[EvalPoint, ...] = ()
        self.contributions: tuple[tuple[str, int, int], ...] = ()
        self.stats: dict[str, dict[str, Any]] = {}
        self.extra: dict[str, dict[str, Any]] = {}  # per peer: reachable, addresses (from heartbeats)
        self.addresses: dict[str, list[str]] = {}  # last addresses of every peer seen (to rejoin the DHT)
        self.ignored: Counter[str] = Counter()
        self.polls = 0
        self.reconnects = 0  # new DHT nodes the dashboard started (`dashboard.command.Poller`)
        self.errors = 0
        self.last_error = ""
        self.last_poll = 0.0
        self._holder: tuple[str, int] | None = None
        self._released: deque[tuple[str, int]] = deque(maxlen=64)  # (holder, term) of leases seen released

    # ---- reading ------------------------------------------------------------------------------------

    def poll(self, kv: KeyValueStore, now: float) -> None:
        """One read of the swarm; a failed read (timeout, DHT down) is counted and leaves the view as it
        was."""
        try:
            reads = _OnePoll(kv)
            status = swarm_status(reads, self.manifest, now)
            extra = self._heartbeat_extras(reads, now)
            stats = self._stats(reads, now)
            histories = self._histories(reads, now)
        except Exception as exc:  # noqa: BLE001 - the page keeps what it had
            with self._lock:
                self.errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"[:300]
            return
        with self._lock:
            self.polls += 1
            self.last_poll = now
            self.status, self.extra = status, extra
            self.stats.update(stats)
            for peer_id, fields in extra.items():
                if fields["addresses"]:
                    self.addresses[peer_id] = fields["addresses"]
            while len(self.addresses) > MAX_ADDRESSES:
                self.addresses.pop(next(iter(self.addresses)))
            self.history = merge_points(self.history, merge_records(histories))
            if histories:
                rows = (h.contributions for h in histories.values())
                best = max(rows, key=lambda rows: sum(r[1] for r in rows))
                if sum(r[1] for r in best) >= sum(r[1] for r in self.contributions):
                    self.contributions = best
            self._sample(status, now)

    def _heartbeat_extras(self, reads: _OnePoll, now: float) -> dict[str, dict[str, Any]]:
        out = {}
        for peer_id, stored in every_heartbeat(reads, self.manifest, now).items():
            try:
                info = decode_heartbeat(stored.value, self.fragments)
            except RecordError:
                continue  # counted by swarm_status
            out[peer_id] = {"reachable": info.reachable, "addresses": list(info.addresses)}
        return out

    def _stats(self, reads: _OnePoll, now: float) -> dict[str, dict[str, Any]]:
        out = {}
        for peer_id, stored in reads.get(
            stats_key(self.manifest.run_id, self.manifest.manifest_hash), now
        ).items():
            try:
                stats = decode_peer_stats(stored.value)
            except RecordError:
                self.ignored["bad stats"] += 1
                continue
            out[peer_id] = {**stats.__dict__, "seen": now}
        return out

    def _histories(self, reads: _OnePoll, now: float) -> dict[str, EvalHistory]:
        records, ignored = eval_histories(reads, self.manifest, now)
        self.ignored.update(ignored)
        return records

    def _sample(self, status: dict[str, Any], now: float) -> None:
        sync = status["synchronizer"]
        holder = (sync["peer_id"], sync["term"]) if sync else None
        versions, term = [f["version"] for f in status["fragments"]], status["highest_term"]
        if not status["peers"] and self.samples:  # nobody reports versions now: not a drop to 0
            versions, term = self.samples[-1]["versions"], max(term, self.samples[-1]["term"])
        training = [p["loss"] for p in status["peers"] if p["loss"] > 0 and math.isfinite(p["loss"])]
        self.samples.append(
            {
                "t": now,
                "versions": versions,
                "term": term,
                "live_peers": len(status["peers"]),  # 0: versions and term are the last known
                "holder": holder[0] if holder else None,
                # the live peers' own reports: their summed tokens/s and mean training loss
                "tokens_per_s": sum(p["tokens_per_s"] for p in status["peers"]),
                "train_loss": sum(training) / len(training) if training else None,
            }
        )
        for lease in status["leases"]:
            if lease["released"] and (lease["peer_id"], lease["term"]) not in self._released:
                self._released.append((lease["peer_id"], lease["term"]))
        previous = self._holder
        if holder is not None and previous is not None and holder != previous and holder[0] != previous[0]:
            released = previous in self._released  # seen released in this poll or an earlier one
            self.marks.append(
                {
                    "t": now,
                    "kind": "rotation" if released else "failover",
                    "from": previous[0],
                    "to": holder[0],
                    "term": holder[1],
                }
            )
        if holder is not None:
            self._holder = holder

    def _fragments(self, status: dict[str, Any]) -> list[dict[str, Any]]:
        """The fragments' versions; while no peer is live, the last known (a live peer's report)."""
        if status["peers"] or not self.samples:
            return status["fragments"]
        return [{"index": i, "version": v} for i, v in enumerate(self.samples[-1]["versions"])]

    def known_addresses(self) -> list[str]:
        with self._lock:
            return [a for addresses in self.addresses.values() for a in addresses]

    # ---- the view ------------------------------------------------------------------------------------

    def view(self, now: float) -> dict[str, Any]:
        """The JSON every endpoint serves a part of (`/api/summary` serves all of it)."""
        with self._lock:
            status = self.status or {"peers": [], "synchronizer": None, "fragments": [], "highest_term": 0}
            return {
                "run_id": self.manifest.run_id,
                "manifest_hash": self.manifest.manifest_hash,
                "time": now,
                "synchronizer": status["synchronizer"],
                "highest_term": status["highest_term"],
                "shards": status.get("shards", []),  # each synchronizer shard's fragments, holder and term
                "fragments": self._fragments(status),
                "peers": self._peer_rows(status, now),
                "eval": [p.as_dict() for p in self.history],
                "versions": {"samples": list(self.samples), "marks": list(self.marks)},
                "contributions": [
                    {"peer_id": peer, "tokens": tokens, "updates": updates}
                    for peer, tokens, updates in self.contributions
                ],
                "rejections": self._rejections(status),
                "bytes": self._bytes(status),
                "health": self._health(status, now),
            }

    def _peer_rows(self, status: dict[str, Any], now: float) -> list[dict[str, Any]]:
        """One row per live peer: its heartbeat's fields with its stats record's (uptime, device, bytes), its
        link, and how many versions it lags behind the fragments' (summed over fragments)."""
        top = [f["version"] for f in status["fragments"]]
        peers = []
        for p in status["peers"]:
            stats = self.stats.get(p["peer_id"], {})
            extra = self.extra.get(p["peer_id"], {})
            lag = sum(max(0, t - v) for t, v in zip(top, p["versions"])) if p["versions"] else None
            peers.append(
                {
                    "peer_id": p["peer_id"],
                    "listed": p["listed"],  # false: the row is the peer's own claims
                    "role": p["role"],
                    "tokens_per_s": p["tokens_per_s"],
                    "uptime": now - stats["started_at"] if "started_at" in stats else None,
                    "link": "direct" if extra.get("reachable", True) else "relayed",
                    "version_lag": lag,
                    "versions": p["versions"],
                    "device": stats.get("device"),
                    "loss": p["loss"],
                    "step": p["step"],
                    "bytes_sent": stats.get("bytes_sent"),
                    "bytes_received": stats.get("bytes_received"),
                }
            )
        return peers

    @staticmethod
    def _rejections(status: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
        """The live peers' rejected inputs, summed by reason and by (sender, reason), most frequent first."""
        reasons: Counter[str] = Counter()
        senders: Counter[tuple[str, str]] = Counter()
        for p in status["peers"]:
            reasons.update(p["rejections"])
            for sender, tag, n in p["rejections_by_sender"]:
                senders[(sender, tag)] += n
        return {
            "by_reason": [{"reason": r, "count": n} for r, n in reasons.most_common()],
            "by_sender": [{"sender": s, "reason": r, "count": n} for (s, r), n in senders.most_common()],
        }

    def _bytes(self, status: dict[str, Any]) -> dict[str, Any]:
        """Bytes sent and received per peer that sent a stats record (live or not), and their sums."""
        live = {p["peer_id"] for p in status["peers"]}
        return {
            "peers": [
                {
                    "peer_id": peer,
                    "sent": s["bytes_sent"],
                    "received": s["bytes_received"],
                    "live": peer in live,
                }
                for peer, s in sorted(self.stats.items())
            ],
            "sent": sum(s["bytes_sent"] for s in self.stats.values()),
            "received": sum(s["bytes_received"] for s in self.stats.values()),
        }

    def _health(self, status: dict[str, Any], now: float) -> dict[str, Any]:
        """The poller's own counts: polls, errors, reconnects, the last error and poll, records ignored."""
        return {
            "polls": self.polls,
            "errors": self.errors,
            "reconnects": self.reconnects,
            "last_error": self.last_error,
            "last_poll_age": now - self.last_poll if self.last_poll else None,
            # the collector counts eval records over all polls, the status of the last poll
            "ignored": dict(status.get("ignored", {})) | dict(self.ignored),
        }
