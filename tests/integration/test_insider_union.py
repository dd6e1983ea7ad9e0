"""Real processes (issue #41): a listed synchronizer that forges the merge of a union round is refused by
every honest replica, and the run goes on.

The real-process version of `tests/sim/test_insider_synchronizer.py`. A bootstrap and three `p2p-diloco
join` processes on 127.0.0.1 of a signed public run under union rounds (`topk4k-int2`, the codec of the
packaged `public` manifest), all three keys listed `[trust] synchronizers`. Two run the product as it is
(the honest peers `a` and `b`); the **insider** runs the same CLI through `tests/support/insider_join.py`,
which patches the one function where a union round's update and checksum are produced
(`Merger.merge_union`): each round it merges lists the learners' genuine signed deltas but claims, by its
checksum, the honest merge plus 0.2 on every weight, a state it installs, serves and pushes.

Order: the honest peers start first; the insider joins once both finished their first catch-up. A replica
refuses what it can merge itself, from its own state at the record's base version; a newcomer whose first
catch-up comes after a forged round has no such state and installs snapshots on the word of leaders it has
not caught (docs/security.md, "What is not protected"), so the honest replicas here exist before the
insider can hold a term. Terms rotate every `TERM_ROUNDS` rounds (`[timing] term_rounds`; a released term
leaves its holder out of the next ranking), so the insider takes a term within a few rotations.

What the product guarantees, and what is asserted (every wait a condition with a deadline):

* the insider's forged rounds are published (its own log) and **every honest replica refuses them** with
  `merge mismatch`, counted against the insider only (`rejections_by_sender` of their heartbeats, what
  `p2p-diloco status --json` shows);
* **no honest replica ever holds a forged state**: no honest `applied`/`replayed` event of an update the
  insider led, no honest heartbeat tip (polled all along) and no honest persisted replica at the end
  with a checksum the insider claimed;
* **the run goes on**: an honest holder publishes in a term after the insider's first forged one and the
  other honest replica applies it; once training stops the honest replicas are equal.

Not asserted, as the product does not promise it: the insider is not voted out. A caught leader vouches
for nothing on the replicas that caught it (`Vouchers.catch`), but its lease still counts (it is listed),
so it keeps taking terms in the rotation (runs here saw it claim again after it was caught) and every
round of those terms is refused; the honest terms between them carry the run. The test does not kill it.

Cost: 42-65 s on the shared 2-core machine (three runs), most of it starting the four processes.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from p2p_diloco.node.export import load_global_replica
from p2p_diloco.node.state import read_events
from p2p_diloco.protocol.messages import UpdateTag
from p2p_diloco.protocol.reconcile import TIP_CHECKSUM_CHARS
from tests.support.insider_join import FORGED_LOG, read_forged
from tests.support.real_swarm import START_TIMEOUT, Joined, Swarm

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[2]
HONEST = ("a", "b")
UNION = {"codec": "topk4k-int2", "density": 0.03}  # union rounds: every replica merges the listed deltas
TERM_ROUNDS = 2  # rounds per term before the holder releases it: the insider gets a term soon
STEP = "0.1"  # seconds per inner step at least: three peers and their daemons share two cores
RUN_ON = 60.0  # from the insider's start to its refusal and an honest term after it


def insider_cli(*args: str) -> list[str]:
    """`python -m tests.support.insider_join ARGS`: the CLI with the insider's forged merge."""
    return [sys.executable, "-m", "tests.support.insider_join", *args]


class Watch:
    """Every (fragment, version, checksum prefix) the honest peers' heartbeats reported."""

    def __init__(self, honest: set[str]):
        self.honest = honest
        self.held: set[tuple[int, int, str]] = set()

    def __call__(self, status: dict) -> dict:
        for row in status["peers"]:
            if row["peer_id"] in self.honest:
                for p, (version, (_, checksum)) in enumerate(zip(row["versions"], row["tips"])):
                    self.held.add((p, version, checksum))
        return status


def rows(status: dict, peers: list[Joined]) -> list[dict]:
    ids = {j.peer_id for j in peers}
    return [row for row in status["peers"] if row["peer_id"] in ids]


def mismatch_senders(row: dict) -> set[str]:
    return {sender for sender, tag, _ in row["rejections_by_sender"] if tag == UpdateTag.MERGE_MISMATCH}


def test_every_honest_replica_refuses_a_listed_insiders_forged_union_round_and_the_run_goes_on(
    spawn, cli, wait_for, start_bootstrap, dht_peers, tmp_path
):
    bootstrap = start_bootstrap()
    observer = dht_peers(initial_peers=bootstrap.addresses, client_mode=True)
    swarm = Swarm(
        spawn, cli, wait_for, tmp_path, bootstrap, observer, names=(*HONEST, "insider"),
        wire=UNION, timing={"term_rounds": TERM_ROUNDS},
    )  # fmt: skip
    honest = [swarm.join(name, "--min-step-time", STEP) for name in HONEST]
    watch = Watch({j.peer_id for j in honest})

    # a replica refuses what it can merge itself: the honest ones are past their first catch-up (so on
    # the run's own states) before the insider exists
    swarm.wait_for(
        lambda: all(any(e["event"].startswith("catch_up") for e in read_events(j.state_dir)) for j in honest),
        START_TIMEOUT,
        "both honest peers' first catch-up",
    )
    log = tmp_path / "forged.jsonl"
    insider = swarm.join(
        "insider",
        "--min-step-time",
        STEP,
        cli=insider_cli,
        env={FORGED_LOG: str(log), "PYTHONPATH": str(REPO_ROOT)},
    )
    started = time.monotonic()
    swarm.wait_status(
        lambda s: bool(watch(s)) and bool(read_forged(log)),
        START_TIMEOUT,
        "the insider's first forged union round",
    )
    forged = read_forged(log)
    first_term = min(f["term"] for f in forged)

    def refused_everywhere(status: dict) -> bool:
        mine = rows(watch(status), honest)
        return len(mine) == len(honest) and all(insider.peer_id in mismatch_senders(row) for row in mine)

    swarm.wait_status(
        refused_everywhere, RUN_ON, "every honest replica refused a forged round: merge mismatch"
    )

    def honest_term_after() -> dict | None:
        """An update an honest peer published in a term after the insider's first forged one, applied by
        the other honest peer."""
        watch(swarm.status())  # the honest tips keep being watched
        for j in honest:
            (other,) = [o for o in honest if o is not j]
            seen = {
                (e["fragment"], e["version"], e["term"])
                for e in read_events(other.state_dir)
                if e["event"] in ("applied", "replayed") and e["leader"] == j.peer_id
            }
            for e in read_events(j.state_dir):
                if e["event"] == "published" and e["term"] > first_term:
                    if (e["fragment"], e["version"], e["term"]) in seen:
                        return e
        return None

    went_on = wait_for(honest_term_after, RUN_ON, f"an honest term after term {first_term}, applied by both")
    print(f"measured: insider started -> refused by both and an honest term {went_on['term']} applied: "
          f"{time.monotonic() - started:.1f} s (first forged term {first_term})")  # fmt: skip

    # stop training everywhere; the honest replicas settle on one state
    for j in swarm.live():
        j.handle.signal(signal.SIGUSR1)
    stable: dict = {"view": None, "since": 0.0}

    def honest_settled(status: dict) -> bool:
        mine = rows(watch(status), honest)
        views = {(row["digest"], tuple(row["versions"])) for row in mine}
        if len(mine) != len(honest) or len(views) != 1 or any(row["tokens_per_s"] > 0 for row in mine):
            stable["view"] = None
            return False
        if views != stable["view"]:
            stable["view"], stable["since"] = views, time.monotonic()
        return time.monotonic() - stable["since"] >= 2.0

    final = swarm.wait_status(honest_settled, 60, "the honest replicas equal with training stopped")
    insider.handle.kill_group()
    for j in honest:
        j.handle.signal(signal.SIGTERM)  # persists the replica
    for j in honest:
        assert j.handle.wait(timeout=60) == 0, j.handle.stderr_tail()

    forged = read_forged(log)
    claimed = {(f["fragment"], f["version"], f["checksum"][:TIP_CHECKSUM_CHARS]) for f in forged}
    assert not claimed & watch.held, f"an honest heartbeat reported a forged state: {claimed & watch.held}"
    for row in rows(final, honest):
        assert mismatch_senders(row) == {insider.peer_id}, row["rejections_by_sender"]
    for j in honest:
        led = [
            e
            for e in read_events(j.state_dir)
            if e["event"] in ("applied", "replayed") and e["leader"] == insider.peer_id
        ]
        assert not led, f"{j.name} applied updates the insider led: {led[:3]}"
        replica, _ = load_global_replica(swarm.manifest, j.state_dir)
        states = {
            (p, replica.version(p), replica.checksum(p)) for p in range(swarm.manifest.diloco.fragments)
        }
        assert not states & {(f["fragment"], f["version"], f["checksum"]) for f in forged}, states
    saved = [load_global_replica(swarm.manifest, j.state_dir)[0] for j in honest]
    assert saved[0].versions() == saved[1].versions() and all(
        saved[0].checksum(p) == saved[1].checksum(p) for p in range(swarm.manifest.diloco.fragments)
    ), "the honest replicas differ"
    assert min(saved[0].versions()) >= 1 and went_on["term"] > first_term
