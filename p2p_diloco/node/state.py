"""A peer's state directory: its persisted replica, when it was last in sync, and its event log.

Layout of ``--state-dir``:

* ``replica/``: the `GlobalReplica`, one safetensors file per fragment (`node.replica_store`: atomic,
  only the fragments that changed, read memory-mapped);
* ``peer_state.json``: run, manifest hash, peer ID, versions, digest, ``last_in_sync`` (DHT time of
  the last save while the peer was live in the swarm) and ``known_peers`` (addresses of live peers at
  that save: a restart dials them besides the bootstrap nodes) and ``term_seen`` (the term floor a
  restart starts from); written atomically after the replica;
* ``events.jsonl``: one JSON object per line, ``{"t": dht_time, "event": kind, ...}``: every decision
  the `Peer` notes, updates applied, progress, start and stop; past `MAX_EVENTS_BYTES` it is renamed
  to ``events.jsonl.1`` (replacing the previous one) and a new file is started;
* ``.lock``: an exclusive `flock` so two processes never share one state directory.

A state directory belongs to one run and manifest: reusing it for another is refused.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import Tensor

from p2p_diloco.config import RunManifest
from p2p_diloco.errors import ConfigError
from p2p_diloco.files import write_atomic
from p2p_diloco.node.replica_store import Fresh, ReplicaFileError, ReplicaStore, damaged_fragments
from p2p_diloco.protocol.fragments import FragmentPlan
from p2p_diloco.protocol.replica import GlobalReplica

REPLICA_DIR = "replica"
PEER_STATE_FILE = "peer_state.json"
EVENTS_FILE = "events.jsonl"
LOCK_FILE = ".lock"
LOCK_POLL_SECONDS = 0.05
MAX_EVENTS_BYTES = 64 * 1024 * 1024

MAX_KNOWN_PEERS = 16  # addresses kept in peer_state.json


@dataclass(frozen=True)
class PeerState:
    """What `peer_state.json` holds."""

    run_id: str
    manifest_hash: str
    peer_id: str
    versions: tuple[int, ...]
    digest: str
    last_in_sync: float
    saved_at: float
    known_peers: tuple[str, ...] = ()  # other live peers' addresses when saved (extra initial peers)
    term_seen: int = 0  # the highest lease term trusted when saved: a restart keeps its term floor
    shard_terms: tuple[int, ...] = ()  # the same per synchronizer shard (shard 0's is `term_seen`)


class StateDir:
    """Owns one state directory for the lifetime of a node (it holds the directory's lock)."""

    def __init__(self, path: str | os.PathLike[str], manifest: RunManifest, *, lock_wait: float = 0.0):
        """`lock_wait`: seconds to wait for the directory's lock (a hot spare taking over from a process
        whose helpers are still exiting); 0 refuses a directory in use at once."""
        self.path = Path(path)
        self.manifest = manifest
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--state-dir {self.path}: cannot create it: {exc.strerror}") from exc
        self._lock_file = open(self.path / LOCK_FILE, "w")  # noqa: SIM115 - held until close()
        deadline = time.monotonic() + lock_wait
        while True:
            try:
                fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError as exc:
                if time.monotonic() < deadline:
                    time.sleep(LOCK_POLL_SECONDS)
                    continue
                self._lock_file.close()
                raise ConfigError(
                    f"--state-dir {self.path} is in use by another running peer; give each peer its own"
                ) from exc
        self._events: TextIO = open(self.path / EVENTS_FILE, "a", buffering=1)  # noqa: SIM115
        self._events_lock = threading.Lock()
        self._events_bytes = self._events.tell()
        self.store = ReplicaStore(self.replica_path)

    @property
    def replica_path(self) -> Path:
        return self.path / REPLICA_DIR

    # ---- peer state and replica --------------------------------------------------------------------

    def read_peer_state(self) -> PeerState | None:
        """The saved peer state, None for a fresh directory; `ConfigError` if it belongs to another run."""
        file = self.path / PEER_STATE_FILE
        if not file.exists():
            return None
        try:
            raw = json.loads(file.read_text())
            raw["known_peers"] = tuple(str(a) for a in raw.get("known_peers", ()))[:MAX_KNOWN_PEERS]
            raw["shard_terms"] = tuple(int(t) for t in raw.get("shard_terms", ()))
            state = PeerState(**{**raw, "versions": tuple(raw["versions"])})
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise ConfigError(
                f"{file} is unreadable ({exc}); remove it (the peer then rejoins by snapshot)"
            ) from exc
        if (state.run_id, state.manifest_hash) != (self.manifest.run_id, self.manifest.manifest_hash):
            raise ConfigError(
                f"--state-dir {self.path} belongs to run {state.run_id!r} "
                f"with manifest {state.manifest_hash}, "
                f"not run {self.manifest.run_id!r} with manifest {self.manifest.manifest_hash}; "
                "give this run its own state directory"
            )
        return state

    def load_replica(
        self, plan: FragmentPlan, *, now: float | None = None, fresh: Fresh | None = None
    ) -> GlobalReplica | None:
        """The persisted replica, or None if there is none or none of it is usable. A fragment whose file
        alone is damaged restarts from the initial weights at version 0 (`fresh`, default: the manifest's
        model built again), so catch-up fetches only it; each refusal is said on stderr and logged."""
        if not self.store.exists():
            return None
        t = time.time() if now is None else now  # DHT time is wall time (hivemind's get_dht_time)
        try:
            return self.store.load(plan)
        except ReplicaFileError as exc:
            bad = damaged_fragments(self.replica_path, plan)
            if not bad or len(bad) == plan.num_fragments:  # the folder as a whole (or all of it) is unusable
                self.event("replica_unusable", t=t, reason=str(exc))
                self.say(
                    f"replica in {self.replica_path} unusable ({exc}); fetching all of it from the swarm"
                )
                return None
        for p, reason in bad.items():
            self.event("replica_unusable", t=t, reason=reason, fragment=p)
            self.say(f"replica fragment {p} damaged ({reason}); fetching only it from the swarm")
        try:
            return self.store.salvage(plan, fresh or self._initial_fragments(plan), bad)
        except (ValueError, TypeError, RuntimeError) as exc:
            self.event("replica_unusable", t=t, reason=f"salvage failed: {exc}")
            self.say(f"replica unusable ({exc}); fetching all of it from the swarm")
            return None

    def _initial_fragments(self, plan: FragmentPlan) -> Fresh:
        """Fragments of the run's initial model (built once, as every peer builds it), zero momentum."""
        initial: dict[str, Tensor] = {}

        def fragment(p: int) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
            if not initial:
                from p2p_diloco.model.gpt import build_model

                for name, param in build_model(self.manifest.model).named_parameters():
                    initial[name] = param.detach().to("cpu", torch.float32)
            theta = {n: initial[n].clone() for n in plan.names(p)}
            return theta, {n: torch.zeros_like(x) for n, x in theta.items()}

        return fragment

    @staticmethod
    def say(line: str) -> None:
        print(f"p2p-diloco: {line}", file=sys.stderr, flush=True)

    def save(
        self,
        replica: GlobalReplica,
        peer_id: str,
        *,
        now: float,
        in_sync: bool,
        previous: float,
        known_peers: tuple[str, ...] = (),
        term_seen: int = 0,
        shard_terms: tuple[int, ...] = (),
    ) -> None:
        """Persist the replica, then the peer state (so the state never claims a replica not on disk)."""
        self.store.save(replica)
        state = PeerState(
            run_id=self.manifest.run_id,
            manifest_hash=self.manifest.manifest_hash,
            peer_id=peer_id,
            versions=replica.versions(),
            digest=replica.digest(),
            last_in_sync=now if in_sync else previous,
            saved_at=now,
            known_peers=known_peers[:MAX_KNOWN_PEERS],
            term_seen=term_seen,
            shard_terms=shard_terms,
        )
        write_atomic(self.path / PEER_STATE_FILE, json.dumps(asdict(state), indent=1).encode())

    # ---- events ------------------------------------------------------------------------------------

    def event(self, kind: str, *, t: float | None = None, **fields: Any) -> None:
        """Append one event line (thread-safe; never raises for a full disk, which only loses the line)."""
        line = json.dumps({"t": t, "event": kind, **fields}, default=str) + "\n"
        with self._events_lock:
            try:
                if self._events_bytes + len(line) > MAX_EVENTS_BYTES:
                    self._events.close()
                    os.replace(self.path / EVENTS_FILE, self.path / f"{EVENTS_FILE}.1")
                    self._events = open(self.path / EVENTS_FILE, "a", buffering=1)  # noqa: SIM115
                    self._events_bytes = 0
                self._events.write(line)
                self._events_bytes += len(line)
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        with self._events_lock:
            self._events.close()
        self._lock_file.close()


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All complete event lines of a state directory's `events.jsonl` (for tests and tools)."""
    file = Path(path) / EVENTS_FILE
    if not file.exists():
        return []
    events = []
    for line in file.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue  # a line being written right now
    return events


def read_peer_state(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """`peer_state.json` of a state directory as a dict, None if absent (for tests and tools)."""
    file = Path(path) / PEER_STATE_FILE
    return json.loads(file.read_text()) if file.exists() else None
