"""A restarted bootstrap node must not split the run (#31), with real processes on 127.0.0.1.

A bootstrap node watching a signed public run (``--manifest --state-dir``) and two peers train; the
bootstrap is SIGKILLed and started again on the same address and key, first with its saved peers wiped
(the peers re-dial it) and then as it saved them (it dials them): both times a fresh observer through it
sees the peers. A newcomer through it then joins the real swarm and catches up, never publishing from
version 0.
Then every process goes, the bootstrap comes back alone, and a second newcomer reaches nobody: it learns
from the bootstrap's saved proof (an update header signed by a listed synchronizer) that the run is under
way, claims no term, publishes nothing and says why in its decisions (what ``status`` shows). A second
test takes a run's first bootstrap node down for good: a newcomer with both addresses joins through the
second one.

Every condition is awaited with a deadline; nothing is timed.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.net.bootstrap_state import STATE_FILE
from p2p_diloco.net.dht_store import DhtKeyValueStore
from p2p_diloco.net.identity import write_identity
from p2p_diloco.net.manifest_signature import load_run_manifest, sign_manifest
from p2p_diloco.node.state import read_events, read_peer_state
from p2p_diloco.wire.keys import heartbeat_key
from p2p_diloco.wire.records import decode_heartbeat
from tests.support.manifests import tiny_swarm_toml

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.soak]

LOOPBACK_LISTEN = "/ip4/127.0.0.1/tcp/0"
START_TIMEOUT = 90.0
NAMES = ("p0", "p1", "late", "island")


class Run:
    def __init__(self, spawn, cli, wait_for, tmp: Path):
        self.spawn, self.cli, self.wait_for, self.tmp = spawn, cli, wait_for, tmp
        self.ids = {name: write_identity(tmp / f"{name}.key") for name in NAMES}
        organizer = write_identity(tmp / "org.key")
        self.bootstrap_id = write_identity(tmp / "bootstrap.key")
        trust = {"authority": organizer, "synchronizers": [self.ids[n] for n in NAMES]}
        self.manifest_path = tmp / "run.toml"
        self.manifest_path.write_text(tiny_swarm_toml("restart", trust=trust))
        sign_manifest(self.manifest_path, tmp / "org.key")
        self.manifest = load_run_manifest(self.manifest_path)
        self.handles: dict[str, object] = {}
        self.listen = LOOPBACK_LISTEN
        self.addresses: list[str] = []

    def start_bootstrap(self):  # noqa: ANN201
        cmd = self.cli(
            "bootstrap", "--identity", str(self.tmp / "bootstrap.key"), "--listen", self.listen,
            "--manifest", str(self.manifest_path), "--state-dir", str(self.tmp / "bootstrap-state"),
        )  # fmt: skip
        handle = self.spawn(cmd)
        lines = handle.wait_for_lines("bootstrap address: ", timeout=START_TIMEOUT)
        self.addresses = [line.removeprefix("bootstrap address: ").strip() for line in lines]
        self.listen = self.addresses[0].rsplit("/p2p/", 1)[0]  # a restart keeps the address
        self.handles["bootstrap"] = handle
        return handle

    def join(self, name: str):  # noqa: ANN201
        cmd = self.cli(
            "join", str(self.manifest_path), "--initial-peers", *self.addresses,
            "--identity", str(self.tmp / f"{name}.key"), "--state-dir", str(self.state(name)),
            "--listen", LOOPBACK_LISTEN, "--min-step-time", "0.05", "--persist-every", "1",
            "--progress-every", "2",
        )  # fmt: skip
        self.handles[name] = handle = self.spawn(cmd)
        return handle

    def state(self, name: str) -> Path:
        return self.tmp / f"state-{name}"

    def versions(self, name: str) -> tuple[int, ...]:
        saved = read_peer_state(self.state(name))
        return tuple(saved["versions"]) if saved else ()

    def events(self, name: str) -> list[dict]:
        return read_events(self.state(name)) if self.state(name).exists() else []

    def alive(self, *names: str) -> None:
        for name in names:
            handle = self.handles[name]
            code = handle.popen.poll()
            assert code is None, f"{name} exited with {code}\n{handle.stderr_tail()}"

    def bootstrap_state(self) -> dict:
        try:
            return json.loads((self.tmp / "bootstrap-state" / STATE_FILE).read_text())
        except (OSError, ValueError):
            return {}


@pytest.fixture
def run(spawn, cli, wait_for, tmp_path) -> Run:  # noqa: ANN001
    return Run(spawn, cli, wait_for, tmp_path)


def test_a_newcomer_through_a_restarted_bootstrap_joins_the_swarm_and_alone_never_starts_from_zero(
    run: Run, dht_peers
) -> None:  # noqa: ANN001
    run.start_bootstrap()
    run.join("p0")
    run.join("p1")

    def trained() -> bool:
        run.alive("p0", "p1")
        state = run.bootstrap_state()
        return (
            all(min(run.versions(n) or (0,)) >= 2 for n in ("p0", "p1"))
            and bool(state.get("proof"))
            and {run.ids["p0"], run.ids["p1"]} <= {a.rsplit("/p2p/", 1)[-1] for a in state.get("peers", ())}
        )

    run.wait_for(
        trained, START_TIMEOUT, "two peers at v2 and the bootstrap's saved peers and proof", interval=0.3
    )

    def sees(*names: str) -> bool:  # a fresh observer through the bootstrap only: what `status` sees
        observer = dht_peers(initial_peers=run.addresses, client_mode=True)
        try:
            found = DhtKeyValueStore(observer, timeout=5.0).get(key, get_dht_time())
        except TimeoutError:
            return False
        finally:
            observer.shutdown()
        return {run.ids[n] for n in names} <= set(found)

    key = heartbeat_key(run.manifest.run_id, run.manifest.manifest_hash)
    # Restart the bootstrap with no saved peers: the peers re-dial it (net/redial.py), so it sees them.
    run.handles["bootstrap"].kill_group()
    state_file = run.tmp / "bootstrap-state" / STATE_FILE
    state_file.write_text(json.dumps({**run.bootstrap_state(), "peers": []}))
    run.start_bootstrap()
    run.wait_for(lambda: sees("p0", "p1"), START_TIMEOUT, "p0 and p1 through the bootstrap (their re-dial)")

    # SIGKILL and restart it again (it dials the peers it saved); a newcomer joins through it only
    run.handles["bootstrap"].kill_group()
    run.start_bootstrap()
    run.wait_for(lambda: sees("p0", "p1"), START_TIMEOUT, "p0 and p1 through the bootstrap again")
    at_restart = max(run.versions("p0"), run.versions("p1"))
    run.join("late")

    def caught_up() -> bool:
        run.alive("p0", "p1", "late")
        mine = run.versions("late")
        return bool(mine) and all(v >= w for v, w in zip(mine, at_restart, strict=True))

    run.wait_for(caught_up, START_TIMEOUT, f"the newcomer at the swarm's versions {at_restart}", interval=0.3)
    late = run.events("late")
    assert any(e["event"] == "catch_up" for e in late), late[-20:]
    from_zero = [e for e in late if e["event"] == "published" and e["version"] == 1]
    assert not from_zero, from_zero
    assert not [e for e in late if e["event"] == "claim" and e["term"] == 1], late[-20:]

    # Everyone goes; the bootstrap comes back alone (its saved peers are dead); a newcomer reaches nobody.
    for name in ("late", "p0", "p1", "bootstrap"):
        run.handles[name].kill_group()
    run.start_bootstrap()
    run.join("island")
    observer = dht_peers(initial_peers=run.addresses, client_mode=True)
    kv = DhtKeyValueStore(observer, timeout=5.0)

    waiting_beats: set[float] = set()

    def says_it_waits() -> bool:  # what `status` shows: the decisions in its heartbeat
        run.alive("island")
        try:
            stored = kv.get(key, get_dht_time()).get(run.ids["island"])
        except TimeoutError:
            return False
        if stored is not None:
            info = decode_heartbeat(stored.value, run.manifest.diloco.fragments)
            if any("run under way" in line for line in info.decisions):
                waiting_beats.add(stored.expiration)
        # more heartbeats than fit in heartbeat_ttl: it read the swarm longer than a claim waits to
        return (
            len(waiting_beats) >= 2 * run.manifest.timing.heartbeat_ttl / run.manifest.timing.heartbeat_period
        )

    run.wait_for(
        says_it_waits, START_TIMEOUT, "the island newcomer saying the run is under way", interval=0.3
    )
    run.handles["island"].signal(signal.SIGTERM)
    assert run.handles["island"].wait(timeout=60) == 0, run.handles["island"].stderr_tail()
    island = run.events("island")
    assert not [e for e in island if e["event"] in ("claim", "published")], island[-20:]
    assert not any(run.versions("island")), run.versions("island")


def test_with_its_first_bootstrap_down_for_good_a_newcomer_joins_through_the_second(run: Run) -> None:
    run.start_bootstrap()
    first = list(run.addresses)
    cmd = run.cli(
        "bootstrap", "--identity", str(run.tmp / "second.key"), "--listen", LOOPBACK_LISTEN,
        "--initial-peers", *first,
    )  # fmt: skip
    write_identity(run.tmp / "second.key")
    second = run.spawn(cmd).wait_for_lines("bootstrap address: ", timeout=START_TIMEOUT)
    run.addresses = first + [line.removeprefix("bootstrap address: ").strip() for line in second]
    run.join("p0")

    def trained() -> bool:
        run.alive("p0")
        return min(run.versions("p0") or (0,)) >= 2

    run.wait_for(trained, START_TIMEOUT, "p0 at v2", interval=0.3)
    run.handles["bootstrap"].kill_group()  # the first bootstrap node is gone for good
    at_kill = run.versions("p0")
    run.join("late")  # the manifest's two addresses, the first one dead

    def caught_up() -> bool:
        run.alive("p0", "late")
        mine = run.versions("late")
        return bool(mine) and all(v >= w for v, w in zip(mine, at_kill, strict=True))

    run.wait_for(caught_up, START_TIMEOUT, f"the newcomer at the swarm's versions {at_kill}", interval=0.3)
    late = run.events("late")
    assert not [e for e in late if e["event"] == "published" and e["version"] == 1], late[-20:]
