"""Real swarms for integration tests: a bootstrap, `p2p-diloco join` processes on 127.0.0.1 and a passive
observer of the DHT (`swarm_status`, what `p2p-diloco status` prints).

`Swarm` starts peers of a tiny public manifest (signed by an organizer key, the peers listed as its
synchronizers: the trust rules of docs/security.md in force) with short swarm timing; `sections` change
the manifest (e.g. ``diloco={"synchronizer_shards": 4}``). It waits for every condition with a deadline.
"""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.net.dht_store import DhtKeyValueStore
from p2p_diloco.net.identity import write_identity
from p2p_diloco.net.manifest_signature import load_run_manifest, sign_manifest
from p2p_diloco.node.state import read_events
from p2p_diloco.node.status import swarm_status
from p2p_diloco.protocol.election import LeaseRecord
from p2p_diloco.wire.keys import lease_key
from p2p_diloco.wire.records import decode_lease
from tests.support.manifests import tiny_swarm_toml

LOOPBACK_LISTEN = "/ip4/127.0.0.1/tcp/0"
PEER_NAMES = ("p0", "p1", "p2", "late")
START_TIMEOUT = 90.0  # process start on a loaded 2-core machine: imports, DHT, catch-up
STOP_TIMEOUT = 60.0


@dataclass
class Joined:
    name: str
    handle: object  # conftest.ProcessHandle
    state_dir: Path
    peer_id: str


class Swarm:
    """A bootstrap, the peers started so far and a passive observer of the DHT."""

    def __init__(
        self,
        spawn,
        cli,
        wait_for,
        tmp_path: Path,
        bootstrap,
        observer,
        names: tuple[str, ...] = PEER_NAMES,
        **sections: dict[str, object],
    ):
        self.spawn = spawn
        self.cli = cli
        self.wait_for = wait_for
        self.tmp = tmp_path
        self.bootstrap = bootstrap
        # A signed public run: the organizer's key signs it, the peers' keys are its synchronizers.
        self.ids = {name: write_identity(tmp_path / f"{name}.key") for name in names}
        organizer = write_identity(tmp_path / "org.key")
        trust = {"authority": organizer, "synchronizers": list(self.ids.values())}
        self.manifest_path = tmp_path / "tiny.toml"
        self.manifest_path.write_text(tiny_swarm_toml("itest", trust=trust, **sections))
        sign_manifest(self.manifest_path, tmp_path / "org.key")
        self.manifest = load_run_manifest(self.manifest_path)
        self.kv = DhtKeyValueStore(observer, timeout=5.0)
        self.peers: dict[str, Joined] = {}

    def join(self, name: str, *extra: str, cli=None, env: dict[str, str] | None = None) -> Joined:  # noqa: ANN001
        """Start (or restart, same identity and state dir) peer `name`; `cli` (default: the fixture's) builds
        the command line from the CLI's arguments, `env` adds to the environment."""
        identity = self.tmp / f"{name}.key"
        peer_id = self.ids[name]
        state_dir = self.tmp / f"state-{name}"
        cmd = (cli or self.cli)(
            "join", str(self.manifest_path), "--initial-peers", *self.bootstrap.addresses,
            "--identity", str(identity), "--state-dir", str(state_dir), "--listen", LOOPBACK_LISTEN,
            "--min-step-time", "0.05", "--persist-every", "1", "--progress-every", "2", *extra,
        )  # fmt: skip
        joined = Joined(name, self.spawn(cmd, env=env), state_dir, peer_id)
        self.peers[name] = joined
        return joined

    def status(self) -> dict:
        try:
            return swarm_status(self.kv, self.manifest, get_dht_time())
        except TimeoutError:
            return {"peers": [], "synchronizer": None, "fragments": []}

    def wait_status(self, predicate, timeout: float, what: str) -> dict:
        found: dict = {}

        def check() -> bool:
            self._check_alive()
            status = self.status()
            if predicate(status):
                found.update(status)
                return True
            return False

        try:
            self.wait_for(check, timeout, what, interval=0.3)
        except TimeoutError as exc:
            raise AssertionError(
                f"{exc}\nlast status: {json.dumps(self.status())[:3000]}\n{self.tails()}"
            ) from exc
        return found

    def _check_alive(self) -> None:
        for joined in self.live():
            code = joined.handle.popen.poll()
            if code is not None:
                raise AssertionError(f"peer {joined.name} exited with {code}\n{joined.handle.stderr_tail()}")

    def live(self) -> list[Joined]:
        return [j for j in self.peers.values() if j.handle.popen.poll() is None]

    def by_id(self, peer_id: str) -> Joined:
        return next(j for j in self.peers.values() if j.peer_id == peer_id)

    def tails(self) -> str:
        return "\n".join(f"--- {j.name} stderr:\n{j.handle.stderr_tail(15)}" for j in self.peers.values())

    def quiesce(self, count: int, timeout: float = 60.0) -> dict:
        """SIGUSR1 every live peer (stop training), then wait for `count` identical, unchanging replicas."""
        for joined in self.live():
            joined.handle.signal(signal.SIGUSR1)
        stable: dict[str, object] = {"view": None, "since": 0.0}

        def settled(status: dict) -> bool:
            peers = status["peers"]
            views = {(p["digest"], tuple(p["versions"])) for p in peers}
            if len(peers) != count or any(p["tokens_per_s"] > 0 for p in peers) or len(views) != 1:
                stable["view"] = None
                return False
            if views != stable["view"]:
                stable["view"], stable["since"] = views, time.monotonic()
            # in-flight deltas merge within a round; give them a few heartbeats to land
            return time.monotonic() - stable["since"] >= 2.0

        return self.wait_status(settled, timeout, f"{count} peers stopped training with identical replicas")

    def kill_synchronizer(self, status: dict) -> tuple[Joined, float]:
        """SIGKILL the holder named in `status`; wait for a higher term and its first merged update.

        Returns the victim and the failover time (kill -> first update of the new term, from event logs).
        """
        timing = self.manifest.timing
        old = status["synchronizer"]
        assert old is not None, status
        victim = self.by_id(old["peer_id"])
        killed_at = time.time()
        victim.handle.kill_group()
        after = self.wait_status(
            lambda s: s["synchronizer"] is not None and s["synchronizer"]["term"] > old["term"],
            timing.lease_ttl + timing.lease_margin + timing.claim_grace + 10,
            "a new synchronizer with a higher term",
        )
        assert after["synchronizer"]["peer_id"] != old["peer_id"]
        survivors = self.live()

        def first_new_term_update() -> dict | None:
            events = [
                e
                for j in survivors
                for e in read_events(j.state_dir)
                if e["event"] in ("published", "applied") and e["term"] > old["term"]
            ]
            return min(events, key=lambda e: e["t"]) if events else None

        first = self.wait_for(first_new_term_update, 15, "the first update of the new term")
        failover = first["t"] - killed_at
        print(f"measured: failover (SIGKILL of the synchronizer -> first merged update of term {first['term']}): "
              f"{failover:.2f} s")  # fmt: skip
        return victim, failover

    def live_lease(self, with_successor: bool = False, shard: int = 0) -> LeaseRecord | None:
        """The live lease of `shard` of the highest term in the DHT (optionally: only one that names a
        successor)."""
        now = get_dht_time()
        try:
            stored = self.kv.get(lease_key(self.manifest.run_id, self.manifest.manifest_hash, shard), now)
        except TimeoutError:
            return None
        leases = [decode_lease(holder, value.value) for holder, value in stored.items()]
        live = [x for x in leases if x.live(now) and (x.successor or not with_successor)]
        return max(live, key=lambda x: (x.term, x.expires_at), default=None)

    def stop_all(self) -> None:
        live = self.live()
        for joined in live:
            joined.handle.signal(signal.SIGTERM)
        for joined in live:
            code = joined.handle.wait(timeout=STOP_TIMEOUT)
            assert code == 0, f"{joined.name} exited with {code}\n{joined.handle.stderr_tail()}"


def incarnations(state_dir: Path) -> list[list[dict]]:
    """The event log split at each process start."""
    runs: list[list[dict]] = []
    for event in read_events(state_dir):
        if event["event"] == "start" or not runs:
            runs.append([])
        runs[-1].append(event)
    return runs


def claims_of(joined: Joined, above_term: int, shard: int = 0) -> list[dict]:
    """`joined`'s claims of a term above `above_term` of synchronizer `shard`."""
    return [
        e
        for e in read_events(joined.state_dir)
        if e["event"] == "claim" and e["term"] > above_term and e.get("shard", 0) == shard
    ]


def step_downs(joined: Joined) -> int:
    """How many times `joined`'s current process stepped down from a term it held (of any shard)."""
    return sum(
        e["event"] == "note" and e["line"].startswith("election: step_down:")
        for e in incarnations(joined.state_dir)[-1]
    )


def assert_no_update_applied_twice(swarm: Swarm) -> None:
    for joined in swarm.peers.values():
        for run in incarnations(joined.state_dir):
            seen = Counter(
                (e["fragment"], e["version"]) for e in run if e["event"] in ("applied", "published")
            )
            twice = [key for key, n in seen.items() if n > 1]
            assert not twice, f"{joined.name} applied updates (fragment, version) {twice} more than once"
