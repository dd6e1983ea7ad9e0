"""A 2-rank island (torchrun, gloo on CPU) and a single-process learner in one real swarm.

Checks, in order: both learners contribute (each one's delta merged, seen in the DHT status) and the
island announces ``ranks: 2``; SIGKILL of the island's rank 1 takes the whole island out (torchrun's
behaviour); the island restarted with the same identity and state dir rejoins by replay and its deltas
are merged again; after SIGUSR1 (finish training) both ranks write the digest of their parameters at
the same step: equal, and every cross-rank comparison made after each broadcast of an adopted fragment
agreed. The ranks run in their own sessions (torchrun starts them so), so teardown kills their groups
by the pids they wrote into the state dir, also when the test failed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.config import RunManifest
from p2p_diloco.net.dht_store import DhtKeyValueStore
from p2p_diloco.net.identity import write_identity
from p2p_diloco.node.state import read_events, read_peer_state
from p2p_diloco.node.status import swarm_status
from tests.support.manifests import tiny_swarm_toml

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.soak]

LOOPBACK_LISTEN = "/ip4/127.0.0.1/tcp/0"
MANIFEST = tiny_swarm_toml("island-itest", timing={"rejoin_grace": 60.0})
START_TIMEOUT = 120.0  # two ranks + a learner starting on a loaded 2-core machine
COMMON = (
    "--listen",
    LOOPBACK_LISTEN,
    "--min-step-time",
    "0.05",
    "--persist-every",
    "1",
    "--progress-every",
    "2",
)


def read_pid(state_dir: Path, rank: int) -> int | None:
    try:
        return int((state_dir / f"island-rank{rank}.pid").read_text())
    except (OSError, ValueError):
        return None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z")


@pytest.fixture
def rank_pids() -> Iterator[set[int]]:
    """Pids of island ranks seen by the test; each one's process group is SIGKILLed at teardown."""
    pids: set[int] = set()
    yield pids
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def test_island_of_two_ranks_contributes_survives_a_rank_kill_and_keeps_ranks_identical(
    spawn, cli, wait_for, start_bootstrap, dht_peers, tmp_path, rank_pids
):
    bootstrap = start_bootstrap()
    observer = DhtKeyValueStore(dht_peers(initial_peers=bootstrap.addresses, client_mode=True), timeout=5.0)
    manifest_path = tmp_path / "tiny.toml"
    manifest_path.write_text(MANIFEST)
    manifest = RunManifest.load(manifest_path)
    peer_ids, state_dirs = {}, {}
    for name in ("island", "single"):
        peer_ids[name] = write_identity(tmp_path / f"{name}.key")
        state_dirs[name] = tmp_path / f"state-{name}"
    island_dir = state_dirs["island"]

    def join_args(name: str) -> list[str]:
        return [
            "join", str(manifest_path), "--initial-peers", *bootstrap.addresses,
            "--identity", str(tmp_path / f"{name}.key"), "--state-dir", str(state_dirs[name]), *COMMON,
        ]  # fmt: skip

    def status() -> dict:
        try:
            return swarm_status(observer, manifest, get_dht_time())
        except TimeoutError:
            return {"peers": []}

    def wait_status(predicate, timeout: float, what: str) -> dict:
        seen: dict = {}

        def check() -> bool:
            current = status()
            seen.clear()
            seen.update(current)
            return bool(predicate({p["peer_id"]: p for p in current["peers"]}))

        try:
            wait_for(check, timeout, what, interval=0.3)
        except TimeoutError as exc:
            tails = "\n".join(f"--- {h.cmd[2:5]}:\n{h.stderr_tail(20)}" for h in handles)
            raise AssertionError(f"{exc}\nlast status: {json.dumps(seen)[:2500]}\n{tails}") from exc
        return seen

    def ranks_started() -> tuple[int, int] | None:
        pids = (read_pid(island_dir, 0), read_pid(island_dir, 1))
        if None in pids:
            return None
        rank_pids.update(pids)  # type: ignore[arg-type]
        return pids  # type: ignore[return-value]

    def merged_since(t0: float, peer_id: str) -> list[dict]:
        return [
            e for name in state_dirs for e in read_events(state_dirs[name])
            if e["event"] == "published" and e["t"] > t0 and peer_id in e["contributors"]
        ]  # fmt: skip

    # 1. the island (via the `--nproc` convenience, which execs torchrun) and a single learner
    handles = [spawn(cli(*join_args("single"))), spawn(cli(*join_args("island"), "--nproc", "2"))]
    single, island = handles
    started = time.time()
    rank0, rank1 = wait_for(ranks_started, START_TIMEOUT, "both island ranks to write their pid files")
    first = wait_status(
        lambda peers: (
            peers.keys() == {peer_ids["island"], peer_ids["single"]}
            and all(p["last_contribution_age"] is not None for p in peers.values())
        ),
        START_TIMEOUT,
        "the island and the single learner live, each with a merged delta",
    )
    by_id = {p["peer_id"]: p for p in first["peers"]}
    assert by_id[peer_ids["island"]]["ranks"] == 2 and by_id[peer_ids["single"]]["ranks"] == 1
    assert merged_since(started, peer_ids["island"]) or merged_since(started, peer_ids["single"])
    print(f"measured: island + learner up and both merged {time.time() - started:.1f} s after launch")

    # 2. SIGKILL of rank 1 takes the island out; its state was persisted in sync before
    wait_for(lambda: (read_peer_state(island_dir) or {}).get("last_in_sync", 0) > 0, 30,
             "the island to persist its replica while in sync")  # fmt: skip
    killed_at = time.monotonic()
    os.kill(rank1, signal.SIGKILL)
    code = island.wait(timeout=60)
    assert code != 0, "torchrun should report the failed rank"
    wait_for(lambda: not alive(rank0), 30, "rank 0 to be taken down with the island")
    print(f"measured: island down {time.monotonic() - killed_at:.1f} s after SIGKILL of rank 1")
    for rank in (0, 1):  # a digest written on the way out of the broken island: not the one we check
        (island_dir / f"island-rank{rank}.json").unlink(missing_ok=True)
        (island_dir / f"island-rank{rank}.pid").unlink(missing_ok=True)

    # 3. restart (plain torchrun this time): rejoins by replay, its deltas get merged again
    restarted_at = get_dht_time()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                "-m", "p2p_diloco", *join_args("island")]  # fmt: skip
    island = spawn(torchrun)
    handles.append(island)
    rank0, rank1 = wait_for(ranks_started, START_TIMEOUT, "the restarted ranks' pid files")

    def catch_up() -> dict | None:
        events = read_events(island_dir)
        starts = [i for i, e in enumerate(events) if e["event"] == "start"]
        if len(starts) < 2:
            return None
        return next((e for e in events[starts[-1] :] if e["event"] == "catch_up"), None)

    rejoined = wait_for(catch_up, START_TIMEOUT, "the restarted island's catch-up")
    assert rejoined["mode"] == "replay", rejoined
    wait_for(lambda: merged_since(restarted_at, peer_ids["island"]), START_TIMEOUT,
             "an update merging a delta of the restarted island")  # fmt: skip
    again = wait_status(
        lambda peers: peer_ids["island"] in peers and peers[peer_ids["island"]]["updates_applied"] > 0,
        30,
        "the restarted island applying updates",
    )
    assert {p["peer_id"]: p["ranks"] for p in again["peers"]}[peer_ids["island"]] == 2
    # an adopted fragment reaches rank 1 at rank 0's next step: wait for updates applied while training
    # (not only replayed at the restart), then a few more steps, before stopping
    then = {p["peer_id"]: p for p in again["peers"]}[peer_ids["island"]]
    wait_status(
        lambda peers: (
            peer_ids["island"] in peers
            and peers[peer_ids["island"]]["updates_applied"] >= then["updates_applied"] + 2
            and peers[peer_ids["island"]]["step"] >= then["step"] + 8
        ),
        60,
        "the island adopting updates while it trains",
    )

    # 4. finish training: both ranks write their parameter digests at the same step
    os.kill(rank0, signal.SIGUSR1)

    def digests() -> list[dict] | None:
        try:
            return [json.loads((island_dir / f"island-rank{r}.json").read_text()) for r in (0, 1)]
        except (OSError, ValueError):
            return None

    d0, d1 = wait_for(digests, 60, "both ranks' digest files")
    assert d0["step"] == d1["step"] > 0
    assert d0["digest"] == d1["digest"], (d0, d1)
    assert d0["checks"] == d1["checks"] and d0["mismatches"] == d1["mismatches"] == 0, (d0, d1)
    # the start broadcasts every fragment once; more means adopted updates were broadcast and checked
    assert d1["fragments_broadcast"] > manifest.diloco.fragments and d1["checks"] >= 2, d1
    wait_for(lambda: not alive(rank1), 30, "rank 1 to exit after rank 0's STOP")

    # 5. a graceful stop: SIGTERM to rank 0 ends the island with status 0; then the learner
    os.kill(rank0, signal.SIGTERM)
    assert island.wait(timeout=60) == 0, island.stderr_tail()
    single.signal(signal.SIGTERM)
    assert single.wait(timeout=60) == 0, single.stderr_tail()
