"""The contribution ledger: who contributed how much to every outer update this peer applied.

Every peer (not only the synchronizer) appends one line per applied update to ``ledger.jsonl`` in its
state directory, so the record of a run survives the death of any synchronizer::

    {"t": dht_time, "fragment": 1, "version": 7, "term": 2, "leader": "Qm...",
     "contributors": [["QmA...", weight, tokens], ...]}

``version`` is the fragment's version after the update. ``weight`` is the merge weight the update
record carries (tokens² / steps). ``tokens`` is the share of the peer's training this update credits:
a delta of fragment p carries every token trained since p was last synced, so each trained token is
sent once per fragment, and each of those P updates credits 1/P of it. It is derived as
weight / (tokens per step of the manifest) / P, exact for learners that train with the manifest's batch
(every `join` does), since then tokens / steps is that constant. Summed over a run, a peer's tokens are
then at most what it trained (a delta merged by an old synchronizer and resent can count twice).

`ContributionLedger.follow` reads new updates from the peer's update log whenever a fragment's
version moved, so updates applied by any path (pushed, replayed, or the holder's own) are recorded
exactly once; versions skipped by a snapshot download have no entry. Past `MAX_LEDGER_BYTES` the file
is renamed to ``ledger.jsonl.1`` (replacing the previous one), like the event log.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path
from typing import Any, TextIO

from p2p_diloco.config import RunManifest
from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.wire.frames import decode_update

LEDGER_FILE = "ledger.jsonl"
MAX_LEDGER_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class LedgerEntry:
    """One applied outer update and its contributors as (peer ID, merge weight, tokens)."""

    fragment: int
    version: int
    term: int
    leader: str
    contributors: tuple[tuple[str, float, int], ...]
    t: float | None = None

    def to_json(self) -> str:
        return json.dumps(
            {
                "t": self.t,
                "fragment": self.fragment,
                "version": self.version,
                "term": self.term,
                "leader": self.leader,
                "contributors": self.contributors,  # tuples: JSON arrays
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, line: str) -> LedgerEntry:
        d = json.loads(line)
        return cls(
            fragment=int(d["fragment"]),
            version=int(d["version"]),
            term=int(d["term"]),
            leader=str(d["leader"]),
            contributors=tuple((str(p), float(w), int(n)) for p, w, n in d["contributors"]),
            t=d.get("t"),
        )


def tokens_per_step(manifest: RunManifest) -> int:
    return manifest.diloco.batch_size * manifest.model.block_size


def entry_from_record(record: UpdateRecord, per_step: int, fragments: int, now: float | None) -> LedgerEntry:
    per_credit = per_step * fragments
    return LedgerEntry(
        fragment=record.fragment,
        version=record.to_version,
        term=record.term,
        leader=record.leader,
        contributors=tuple(
            [
                (peer, float(weight), round(weight / per_credit) if per_credit > 0 else 0)
                for peer, weight in record.contributors
            ]
        ),
        t=now,
    )


@dataclass(slots=True)
class PeerContribution:
    """What one peer contributed over the entries summed: tokens, merge weight, and its share.

    ``share`` sums each update's weight fraction (w / Σw), so it counts updates "owned" by the peer.
    """

    tokens: int = 0
    weight: float = 0.0
    share: float = 0.0
    updates: int = 0
    fragments: set[int] = field(default_factory=set)

    def as_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "weight": self.weight,
            "share": self.share,
            "updates": self.updates,
            "fragments": sorted(self.fragments),
        }


def add_entry(totals: dict[str, PeerContribution], entry: LedgerEntry) -> None:
    """`entry` booked in `totals` (every peer books every update it applies: issue #40, hence no call per
    contributor)."""
    total_weight = sum(map(itemgetter(1), entry.contributors))
    fragment = entry.fragment
    for peer, weight, tokens in entry.contributors:
        found = totals.get(peer)
        if found is None:
            found = totals[peer] = PeerContribution()
        found.tokens += tokens
        found.weight += weight
        found.share += weight / total_weight if total_weight > 0 else 0.0
        found.updates += 1
        found.fragments.add(fragment)


def summarize(entries: Iterable[LedgerEntry]) -> dict[str, PeerContribution]:
    totals: dict[str, PeerContribution] = {}
    for entry in entries:
        add_entry(totals, entry)
    return totals


class ContributionLedger:
    """The append side of ``ledger.jsonl`` for one running node (module docstring). Thread-safe."""

    def __init__(self, directory: str | os.PathLike[str], manifest: RunManifest):
        self.path = Path(directory) / LEDGER_FILE
        self.per_step = tokens_per_step(manifest)
        self.max_message_bytes = manifest.wire.max_message_bytes
        self.last_version = [0] * manifest.diloco.fragments
        self.totals: dict[str, PeerContribution] = {}
        self.entries_written = 0
        for entry in read_ledger(self.path.parent):
            if 0 <= entry.fragment < len(self.last_version):
                self.last_version[entry.fragment] = max(self.last_version[entry.fragment], entry.version)
            add_entry(self.totals, entry)
        self._lock = threading.Lock()
        self._file: TextIO = open(self.path, "a", buffering=1)  # noqa: SIM115 - held until close()
        self._bytes = self._file.tell()

    def record(self, record: UpdateRecord, now: float | None) -> LedgerEntry | None:
        """Append the entry of one applied update; None if its version is already in the ledger."""
        p = record.fragment
        if not 0 <= p < len(self.last_version) or record.to_version <= self.last_version[p]:
            return None
        entry = entry_from_record(record, self.per_step, len(self.last_version), now)
        self.last_version[p] = entry.version
        add_entry(self.totals, entry)
        self._write(entry.to_json() + "\n")
        return entry

    def follow(
        self, versions: Sequence[int], update_log: Sequence[Iterable[bytes]], now: float | None
    ) -> list[LedgerEntry]:
        """Record the updates behind every version change since the last call (see the module docstring)."""
        new: list[LedgerEntry] = []
        for p, version in enumerate(versions):
            if version <= self.last_version[p]:
                continue
            missing = version - self.last_version[p]
            for frame in list(update_log[p])[-missing:]:
                try:
                    record = decode_update(frame, max_bytes=self.max_message_bytes)
                except Exception:  # it was applied, so it decodes; never let bookkeeping break the node
                    continue
                entry = self.record(record, now)
                if entry is not None:
                    new.append(entry)
            self.last_version[p] = max(self.last_version[p], version)  # a snapshot skipped the rest
        return new

    def _write(self, line: str) -> None:
        with self._lock:
            try:
                if self._bytes + len(line) > MAX_LEDGER_BYTES:
                    self._file.close()
                    os.replace(self.path, self.path.with_name(f"{LEDGER_FILE}.1"))
                    self._file = open(self.path, "a", buffering=1)  # noqa: SIM115
                    self._bytes = 0
                self._file.write(line)
                self._bytes += len(line)
                self.entries_written += 1
            except (OSError, ValueError):  # a full disk loses the line, never the node
                pass

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_ledger(directory: str | os.PathLike[str]) -> list[LedgerEntry]:
    """Every complete entry of a state directory's ledger (the rotated file first), in file order."""
    entries = []
    for name in (f"{LEDGER_FILE}.1", LEDGER_FILE):
        file = Path(directory) / name
        if not file.exists():
            continue
        for line in file.read_text().splitlines():
            try:
                entries.append(LedgerEntry.from_json(line))
            except (ValueError, KeyError, TypeError):
                continue  # a line being written right now, or damaged
    return entries


def ledger_report(entries: Sequence[LedgerEntry], *, last: int = 0) -> dict[str, Any]:
    """JSON-ready summary: per-peer totals (most tokens first), fragment versions covered, last entries."""
    totals = summarize(entries)
    versions: dict[int, list[int]] = {}
    for entry in entries:
        versions.setdefault(entry.fragment, []).append(entry.version)
    return {
        "entries": len(entries),
        "fragments": {
            str(p): {"first": min(v), "last": max(v), "recorded": len(set(v))}
            for p, v in sorted(versions.items())
        },
        # share: the peer's fraction of the updates (each update's merge weights split it, so the shares
        # of all peers sum to 1); updates_owned: the same in updates (PeerContribution.share)
        "peers": [
            {"peer_id": peer, **c.as_dict(), "share": c.share / len(entries), "updates_owned": c.share}
            for peer, c in sorted(totals.items(), key=lambda kv: (-kv[1].tokens, -kv[1].weight, kv[0]))
        ],
        "recent": [json.loads(e.to_json()) for e in entries[-last:]] if last > 0 else [],
    }


def format_ledger(report: dict[str, Any]) -> str:
    lines = [f"contribution ledger: {report['entries']} updates"]
    for p, span in report["fragments"].items():
        lines.append(f"  fragment {p}: v{span['first']}..v{span['last']} ({span['recorded']} recorded)")
    if report["peers"]:
        lines.append(f"{'peer':<48} {'tokens':>12} {'weight':>12} {'share':>7} {'updates':>8}")
    for row in report["peers"]:
        lines.append(
            f"{row['peer_id']:<48} {row['tokens']:>12} {row['weight']:>12.4g} {row['share']:>7.1%} "
            f"{row['updates']:>8}"
        )
    if report["peers"]:
        lines.append(
            "share: of the updates, split by merge weight; updates: those that merged the peer's delta"
        )
    for e in report["recent"]:
        who = ", ".join(f"{peer[:12]} {w:.3g} ({n} tok)" for peer, w, n in e["contributors"])
        lines.append(f"  fragment {e['fragment']} v{e['version']} term {e['term']}: {who}")
    return "\n".join(lines)
