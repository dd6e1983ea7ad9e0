"""Real swarms: a bootstrap and `p2p-diloco join` processes on 127.0.0.1 (real p2pd, port 0).

Each test starts its own bootstrap and peers with a tiny public manifest (signed by an organizer key,
the peers listed as its synchronizers: the trust rules of docs/security.md in force) and short swarm
timing, watches the
swarm through an in-process passive DHT client (`swarm_status`, what `p2p-diloco status` prints) and
the peers' state directories, and waits for every condition with a deadline. Every process group is
killed at teardown, also when a test fails. Measurements (failover time, snapshot rate, memory) are
printed as ``measured:`` lines (run with ``-s`` to see them).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from p2p_diloco.node.state import read_events, read_peer_state
from tests.support.real_swarm import (
    START_TIMEOUT,
    Joined,
    Swarm,
    assert_no_update_applied_twice,
    claims_of,
    incarnations,
    step_downs,
)

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def swarm(spawn, cli, wait_for, start_bootstrap, dht_peers, tmp_path) -> Swarm:
    bootstrap = start_bootstrap()
    observer = dht_peers(initial_peers=bootstrap.addresses, client_mode=True)
    return Swarm(spawn, cli, wait_for, tmp_path, bootstrap, observer)


def group_pss_mib(pid: int) -> float:
    """PSS of every process in `pid`'s process group (python, its DHT child, p2pd), in MiB."""
    total_kib = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) != pid:
                continue
            for line in Path(f"/proc/{entry}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total_kib += int(line.split()[1])
        except (OSError, ProcessLookupError):
            continue
    return total_kib / 1024


def catch_up_of(joined: Joined) -> dict | None:
    """The catch-up event of `joined`'s latest process start (None before it caught up)."""
    runs = incarnations(joined.state_dir)
    return next((e for e in runs[-1] if e["event"] == "catch_up"), None) if runs else None


def library_thread(name: str) -> bool:
    """Threads that libraries start in a `join` process, not the project's own: hivemind's MPFuture
    backend and multiprocessing's resource sharer (`Thread-N (_serve)`, passing fds to the DHT child)."""
    return name == "hivemind.utils.mpfuture.BACKEND" or name.endswith("(_serve)")


def test_three_peers_train_and_end_with_identical_replicas(swarm):
    peers = [swarm.join(f"p{i}") for i in range(3)]
    swarm.wait_status(
        lambda s: (
            len(s["peers"]) == 3
            and s["synchronizer"]
            and min(f["version"] for f in s["fragments"]) >= 4
            and all(p["last_contribution_age"] is not None for p in s["peers"])
        ),
        START_TIMEOUT,
        "3 live peers, a synchronizer, every fragment at v4 or later and a merged delta from every peer",
    )
    memory = {p.name: group_pss_mib(p.handle.pid) for p in peers}
    print(f"measured: PSS per peer process group (python + DHT child + p2pd), MiB: {memory}")

    final = swarm.quiesce(3)
    assert {p["peer_id"] for p in final["peers"]} == {p.peer_id for p in peers}
    assert all(v >= 4 for v in final["peers"][0]["versions"])
    for peer in final["peers"]:  # every peer's work reached the global model at least once
        assert peer["tokens"] > 0 and peer["last_contribution_age"] is not None, peer
        assert not {"busy", "handler error"} & set(peer["rejections"]), peer["rejections"]

    out = subprocess.run(
        swarm.cli("status", str(swarm.manifest_path), "--initial-peers", *swarm.bootstrap.addresses, "--json"),
        capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    printed = json.loads(out.stdout)
    sync = printed["synchronizer"]
    assert sync["peer_id"] in {p.peer_id for p in peers} and sync["term"] >= 1
    assert printed["fragments"] == final["fragments"]
    assert {p["peer_id"]: (p["digest"], p["versions"]) for p in printed["peers"]} == {
        p["peer_id"]: (p["digest"], p["versions"]) for p in final["peers"]
    }
    holder = swarm.by_id(sync["peer_id"])

    swarm.stop_all()
    saved = [read_peer_state(p.state_dir) for p in peers]
    assert len({s["digest"] for s in saved}) == 1, saved
    assert saved[0]["digest"][:16] == final["peers"][0]["digest"]
    assert any(e["event"] == "released_lease" for e in read_events(holder.state_dir))
    assert_no_update_applied_twice(swarm)
    for peer in peers:  # one owner per peer: the training, owner, DHT I/O and transport threads
        events = read_events(peer.state_dir)
        seen = {name for e in events if e["event"] == "progress" for name in e["threads"]}
        assert {"MainThread", "peer-owner", "p2p-transport"} <= seen, seen
        own = sorted(name for name in seen if not library_thread(name))
        assert len(own) <= 4, (own, sorted(seen))
        # ownership checks are on in the processes tests start (`p2p_diloco.owner`): none failed
        wrong = [e for e in events if e["event"] == "tick_error" and "WrongThread" in e["error"]]
        assert not wrong, wrong


@pytest.mark.soak
@pytest.mark.slow
def test_failover_twice_rejoin_by_replay_and_late_snapshot_joiner(swarm):
    timing = swarm.manifest.timing
    bound = timing.lease_ttl + timing.lease_margin + timing.claim_grace
    for i in range(3):
        swarm.join(f"p{i}")
    swarm.wait_status(
        lambda s: (
            len(s["peers"]) == 3 and s["synchronizer"] and min(f["version"] for f in s["fragments"]) >= 3
        ),
        START_TIMEOUT,
        "3 live peers, a synchronizer and every fragment at v3 or later",
    )
    # rejoin by replay presumes the victim was once persisted while in sync
    swarm.wait_for(
        lambda: all((read_peer_state(j.state_dir) or {}).get("last_in_sync", 0) > 0 for j in swarm.live()),
        30, "every peer to persist its replica while in sync",
    )  # fmt: skip
    at_kill = swarm.wait_status(lambda s: s["synchronizer"] and len(s["peers"]) == 3, 10, "a synchronizer")
    victim, failover = swarm.kill_synchronizer(at_kill)
    version_at_kill = max(f["version"] for f in at_kill["fragments"])
    assert failover <= bound + 3.0, f"failover took {failover:.1f} s, bound {bound:.1f} s + 3 s slack"
    swarm.wait_status(
        lambda s: min(f["version"] for f in s["fragments"]) >= version_at_kill + 3,
        30,
        "versions to keep advancing under the new synchronizer",
    )

    # the killed peer comes back (same identity, same state dir) and a fresh peer joins late
    swarm.join(victim.name)
    late = swarm.join("late")

    rejoined = swarm.wait_for(lambda: catch_up_of(victim) if len(incarnations(victim.state_dir)) == 2 else None,
                          START_TIMEOUT, "the restarted peer's catch-up")  # fmt: skip
    assert rejoined["mode"] == "replay" and rejoined["replayed"] > 0, rejoined
    assert rejoined["away"] < timing.rejoin_grace
    joined_late = swarm.wait_for(lambda: catch_up_of(late), START_TIMEOUT, "the late joiner's catch-up")
    assert joined_late["mode"] == "snapshot" and joined_late["snapshots"] >= 1, joined_late
    sources = {
        e["line"].split(" from ")[1].split(":")[0]
        for e in incarnations(late.state_dir)[-1]
        if e["event"] == "note" and e["line"].startswith("snapshot of fragment")
    }
    rate = joined_late["bytes"] / max(joined_late["seconds"], 1e-9) / 2**20
    print(
        f"measured: late joiner snapshot: {joined_late['snapshots']} fragments, {joined_late['bytes']} bytes "
        f"from {len(sources)} peers in {joined_late['seconds']:.2f} s ({rate:.2f} MiB/s, latency-bound at this size); "
        f"rejoin replayed {rejoined['replayed']} updates in {rejoined['seconds']:.2f} s after {rejoined['away']:.1f} s away"
    )

    swarm.wait_status(
        lambda s: any(
            p["peer_id"] == late.peer_id and p["last_contribution_age"] is not None for p in s["peers"]
        ),
        60,
        "an update that merged the late joiner's delta",
    )
    # a second failover in a row: kill whoever holds the lease now
    _, failover = swarm.kill_synchronizer(
        swarm.wait_status(lambda s: s["synchronizer"], 10, "a synchronizer")
    )
    assert failover <= bound + 3.0, f"second failover took {failover:.1f} s, bound {bound:.1f} s + 3 s slack"
    final = swarm.quiesce(3)
    assert all(v > version_at_kill for v in final["peers"][0]["versions"])
    stopped = swarm.live()
    swarm.stop_all()
    saved = {j.name: read_peer_state(j.state_dir)["digest"] for j in stopped}
    assert len(set(saved.values())) == 1, saved
    assert saved[stopped[0].name][:16] == final["peers"][0]["digest"]
    assert_no_update_applied_twice(swarm)


@pytest.mark.soak
@pytest.mark.slow
def test_crashed_holder_is_succeeded_at_once_and_a_frozen_one_is_fenced_out(swarm):
    """SIGKILL: the holder's named successor sees its connections refused and claims the next term
    before the lease would have run out. SIGSTOP (a frozen holder: connections not refused): the swarm
    waits out its lease, another peer claims in the ordinary way, and once thawed the zombie steps down
    and its late updates are refused by term; the replicas end identical."""
    timing = swarm.manifest.timing
    for i in range(3):
        swarm.join(f"p{i}")
    at_kill = swarm.wait_status(
        lambda s: (
            len(s["peers"]) == 3 and s["synchronizer"] and min(f["version"] for f in s["fragments"]) >= 3
        ),
        START_TIMEOUT,
        "3 live peers, a synchronizer and every fragment at v3 or later",
    )
    # the holder names its successor in every renewal: wait for two renewals naming the same peer, so the
    # successor has read one and is watching
    first = swarm.wait_for(lambda: swarm.live_lease(with_successor=True), 20, "a lease naming a successor")
    swarm.wait_for(
        lambda: (
            (lease := swarm.live_lease(with_successor=True)) is not None
            and lease.successor == first.successor
            and lease.expires_at > first.expires_at
        ),
        20,
        "a renewal naming the same successor",
    )
    at_kill = swarm.wait_status(lambda s: s["synchronizer"] and len(s["peers"]) == 3, 10, "a synchronizer")
    old_term = at_kill["synchronizer"]["term"]
    killed_at = time.time()
    victim, failover = swarm.kill_synchronizer(at_kill)
    claim = swarm.wait_for(
        lambda: next((c for j in swarm.live() for c in claims_of(j, old_term)), None),
        15,
        "the new term's claim",
    )
    assert claim["reason"].startswith("succession"), claim
    print(f"measured: SIGKILL -> successor's claim {claim['t'] - killed_at:.2f} s (lease_ttl {timing.lease_ttl} s), "
          f"-> first update of the new term {failover:.2f} s")  # fmt: skip

    back = swarm.join(victim.name)  # back, with the same identity: three peers again
    swarm.wait_for(lambda: catch_up_of(back) if len(incarnations(back.state_dir)) == 2 else None,
                   START_TIMEOUT, "the restarted peer's catch-up")  # fmt: skip
    held = swarm.wait_for(
        lambda: (lease := swarm.live_lease()) is not None and lease.term > old_term and lease,
        30,
        "a live lease above the killed holder's term",
    )
    frozen_term = held.term
    zombie = swarm.by_id(held.holder)
    os.killpg(zombie.handle.pid, signal.SIGSTOP)  # python, its DHT child and p2pd: alive but silent
    try:
        others = [j for j in swarm.live() if j is not zombie]
        taken = swarm.wait_for(
            lambda: next((c for j in others for c in claims_of(j, frozen_term)), None),
            timing.lease_ttl + timing.lease_margin + 3 * timing.claim_grace + 20,
            "another peer to claim after the frozen holder's lease",
        )
        assert not taken["reason"].startswith("succession"), taken  # silence is not death
    finally:
        os.killpg(zombie.handle.pid, signal.SIGCONT)

    try:  # for the higher term, or its own lease's expiry if it read that first
        swarm.wait_for(lambda: step_downs(zombie) > 0, 30, "the thawed zombie to step down")
    except TimeoutError as exc:
        notes = [e.get("line", e["event"]) for e in incarnations(zombie.state_dir)[-1]][-15:]
        raise AssertionError(f"{exc}; its last events:\n" + "\n".join(map(str, notes))) from exc
    try:
        final = swarm.quiesce(3)
    except AssertionError as exc:
        # Under heavy load the zombie's fork once ended at the winner's versions with another digest. No
        # runtime xfail (#42): it holds or fails; the simulator's freeze seeds cover the same race.
        pytest.fail(f"replicas did not converge after the zombie thawed\n{str(exc)[:2000]}")
    assert final["synchronizer"]["term"] > frozen_term
    stopped = swarm.live()
    swarm.stop_all()
    saved = {j.name: read_peer_state(j.state_dir)["digest"] for j in stopped}
    assert len(set(saved.values())) == 1, saved
    assert_no_update_applied_twice(swarm)
