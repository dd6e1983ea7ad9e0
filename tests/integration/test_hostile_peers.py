"""Hostile peers against a small real public swarm (issue #12, "Public runs that survive strangers").

Each test starts a fresh run (its own run ID, so no forged record of an earlier test is visible) of two
honest `join` processes on the module's bootstrap: both are listed `[trust] synchronizers` of a public
manifest (authority = the first honest peer; signed with `p2p-diloco manifest sign` where that exists).
A **rogue** (`tests/support/rogue.py`: a DHT peer and `P2PTransport` of the same run, in this process)
then runs one attack of the issue's table; two rogue keys exist per module:

* the **stranger**: a peer ID nobody listed (any volunteer on the internet may be one: learners = "any");
* the **insider**: a key listed in `[trust] synchronizers` that does not run an honest peer (a leaked or
  misbehaving synchronizer key), so the lease rules that apply to *listed* holders (term jump, expiry,
  claimed early) are exercised, not only "may not synchronize".

After each attack the test asserts, through `swarm_status` (what `p2p-diloco status` shows) and the
honest peers' state directories:

* the rogue never appears as synchronizer (`status["synchronizer"]`, polled all along) and no honest
  peer adopts its terms (`term_seen`);
* the honest replicas agree: whenever both report the same fragment versions, their replica digests are
  equal (heartbeats carry `versions` and `digest`);
* versions keep advancing after (or during) the attack;
* the held-out eval loss of the honest replicas (read from their persisted ``replica.pt``) does not rise
  by more than `LOSS_SLACK`. A live swarm has no bit-exact honest reference run to compare digests
  with (timing decides which deltas merge), so "digests equal an honest reference" is checked as: the
  honest replicas agree with each other, every rogue update/snapshot was refused, and the eval loss of
  the global model did not rise;
* the attempt shows in the honest peers' `status` rejections with its reason (`REASONS`).

Test names, per row of the issue's table (``[S4]``: the same attack on a run with `synchronizer_shards = 4`
over 4 fragments, its forged lease and update of shard 0, its forged term above every shard's):

| attack | tests |
| --- | --- |
| lease term + 1000, expiry 1 h ahead, then a destructive update | `test_row1_future_lease_and_destructive_update_are_refused[stranger/insider]`, `test_row1_early_claim_of_the_next_term_is_refused`, `test_row1_term_jump_backed_by_a_strangers_heartbeat_is_refused`; with S = 4 shards, a lease of one shard: `test_row1_sharded_future_lease_of_one_shard_vouches_for_no_update[S4]` |
| already-expired lease of the current term, then an update | `test_row2_expired_lease_then_update_is_refused[S1-stranger/S1-insider/S4-insider]` |
| deltas toward the initial weights claiming 10^6 steps | `test_row3_revert_deltas_with_inflated_claims_weigh_no_more_than_an_honest_learner` |
| forged heartbeat: versions + 1000, term_seen + 1000 | `test_row4_forged_heartbeat_neither_deposes_the_holder_nor_halts_training[S1/S4]` |
| forged branch tip, random-weight snapshot served | `test_row5_forged_tip_and_poisoned_snapshot_are_not_adopted_by_replicas_or_a_newcomer` |
| 8 idle streams per honest peer, 200 MiB claimed | `test_row6_idle_streams_claiming_200_mib_do_not_stall_updates_or_deltas` |
| garbage, truncated, wrong shape, NaN, 10^12 tokens, 1e3 values | `tests/integration/test_swarm_bad_input.py` (unchanged) |
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.config import RunManifest
from p2p_diloco.model.data import evaluate, load_corpus
from p2p_diloco.model.gpt import build_model
from p2p_diloco.net.dht_store import DhtKeyValueStore
from p2p_diloco.net.identity import write_identity
from p2p_diloco.net.manifest_signature import load_run_manifest, sign_manifest
from p2p_diloco.node.ledger import read_ledger
from p2p_diloco.node.replica_store import ReplicaFileError, load_replica
from p2p_diloco.node.state import REPLICA_DIR, read_events
from p2p_diloco.node.status import swarm_status
from p2p_diloco.protocol.fragments import plan_fragments
from tests.support.manifests import tiny_swarm_toml
from tests.support.rogue import Rogue

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.soak]

LOOPBACK_LISTEN = "/ip4/127.0.0.1/tcp/0"
START_TIMEOUT = 150.0  # two `join`s on a loaded 2-core machine: imports, DHT, first lease, first updates
ADVANCE_TIMEOUT = 120.0
ADVANCE = 3  # versions every fragment must gain after an attack
# How much worse than the untrained model (ln 256 = 5.55 nats/byte) the global model may get. The eval loss
# of a live two-peer run swings widely on its own (measured on the rules branch: 3.0 -> 5.3 -> 4.3 within
# a minute, every rogue update refused), so "does not rise" is checked as "never worse than untrained";
# before/after losses are printed as measurements. A forged update that gets applied is caught exactly by
# its reply and by the digests; subtle weight gains (row 3) by the merge weights in the ledger.
LOSS_SLACK = 0.5
INNER_STEPS = 8
SHARDED = {"synchronizer_shards": 4, "fragments": 4}  # the two honest peers hold two shards each
# rows that run at S = 1 and at S = 4 (indirect parameter of `hostile_run`): the attacks on what is kept per
# shard (leases, terms). Rows 3, 5 and 6 and the election rows of row 1 run at S = 1 only (CI time).
BOTH_SIZES = pytest.mark.parametrize("hostile_run", [{}, SHARDED], indirect=True, ids=["S1", "S4"])

# The rejection tags the honest peers count for each attack (any one of them shows the attempt).
REASONS = {
    # refused by the lease rules, dropped at the DHT read by net.admission (which must count it too), or its
    # requests refused by the transport's allowlist
    "stranger lease": {"lease holder may not synchronize", "peer not allowed", "not allowed"},
    "insider future lease": {"lease term jump", "lease expiry too far ahead"},
    "insider early claim": {"lease claimed early", "lease term jump"},
    # an update signed by its leader (the rogue's own key) whose leader holds no valid lease live now
    "rogue update": {"not allowed", "no lease", "lease not live", "bad signature", "not the leader"},
    # a snapshot whose state no checked update record (or two peers) vouches for
    "poisoned snapshot": {"unvouched snapshot"},
    # a header claiming 200 MiB is over the exact frame cap: refused before its slot matters; streams
    # opened together beyond the per-peer slots are busy; a silent or slow one times out
    "idle streams": {"frame too large", "peer busy", "too slow", "header timeout"},
}


@dataclass
class Honest:
    name: str
    handle: object  # conftest.ProcessHandle
    state_dir: Path
    peer_id: str


@dataclass
class RogueKeys:
    """The module's two rogue DHT peers (their keys stay the same across the module's runs)."""

    stranger: object  # DhtPeer
    insider: object  # DhtPeer
    folder: Path

    def key(self, name: str) -> Path:
        return self.folder / f"{name}.key"


@dataclass
class HostileRun:
    """One public run: two honest `join`s, an observer, and rogues of this run."""

    manifest: RunManifest
    manifest_path: Path
    peers: dict[str, Honest]
    kv: DhtKeyValueStore
    spawn: Callable
    cli: Callable
    bootstrap: object
    tmp: Path
    wait_for: Callable
    rogues: dict[str, Rogue] = field(default_factory=dict)
    seen: list[dict] = field(default_factory=list)  # every status read, for "never synchronizer"

    # ---- reading the swarm ----------------------------------------------------------------------

    def status(self) -> dict:
        try:
            status = swarm_status(self.kv, self.manifest, get_dht_time())
        except TimeoutError:
            return {"peers": [], "synchronizer": None, "fragments": [], "leases": []}
        self.seen.append(status)
        return status

    def honest(self, status: dict) -> dict[str, dict]:
        ids = {p.peer_id for p in self.peers.values()}
        return {p["peer_id"]: p for p in status["peers"] if p["peer_id"] in ids}

    def wait_status(self, predicate: Callable[[dict], object], timeout: float, what: str) -> dict:
        found: dict = {}

        def check() -> bool:
            for joined in self.peers.values():
                code = joined.handle.popen.poll()
                if code is not None:
                    raise AssertionError(f"{joined.name} exited with {code}\n{joined.handle.stderr_tail()}")
            status = self.status()
            if predicate(status):
                found.update(status)
                return True
            return False

        try:
            self.wait_for(check, timeout, what, interval=0.3)
        except TimeoutError as exc:
            raise AssertionError(
                f"{exc}\nlast status: {json.dumps(self.status())[:4000]}\n{self.tails()}"
            ) from exc
        return found

    def tails(self) -> str:
        return "\n".join(f"--- {j.name} stderr:\n{j.handle.stderr_tail(15)}" for j in self.peers.values())

    def floor(self, status: dict, names: tuple[str, ...] | None = None) -> tuple[int, ...]:
        """Per fragment, the lowest version any honest peer (of `names`) reports."""
        ids = {self.peers[n].peer_id for n in names} if names else None
        honest = [p for pid, p in self.honest(status).items() if ids is None or pid in ids]
        if not honest or any(not p["versions"] for p in honest):
            return (0,) * self.manifest.diloco.fragments
        return tuple(min(p["versions"][i] for p in honest) for i in range(self.manifest.diloco.fragments))

    def ready(self, status: dict, at_least: int = 2) -> bool:
        """Both honest peers live, an honest synchronizer, and every fragment at `at_least` or more."""
        honest = self.honest(status)
        sync = status["synchronizer"]
        return (
            len(honest) == len(self.peers)
            and sync is not None
            and sync["peer_id"] in honest
            and min(self.floor(status)) >= at_least
        )

    # ---- the outcomes every attack is checked for ----------------------------------------------------

    def wait_advanced(self, before: dict, by: int = ADVANCE, names: tuple[str, ...] | None = None) -> dict:
        start = self.floor(before, names)
        return self.wait_status(
            lambda s: all(v >= b + by for v, b in zip(self.floor(s, names), start)),
            ADVANCE_TIMEOUT,
            f"every fragment of every honest replica to advance {by} versions past {start}",
        )

    def wait_agreeing(self, names: tuple[str, ...] | None = None) -> dict:
        """Until, for every fragment, every honest peer (`names`) has been seen at one same version of it,
        not necessarily at the same instant. Each fragment's tip checksum reported at a version, and each
        digest reported at a whole versions tuple, must be the same for every peer seen there.

        Agreement is checked per fragment because a whole tuple is rarely seen on every peer: with two
        fragments updated every ~0.2 s and heartbeats every 0.5 s, a tuple lasts about one heartbeat,
        and three out-of-phase heartbeats can miss it for minutes under CI load (seen once)."""
        ids = {self.peers[n].peer_id for n in (names or tuple(self.peers))}
        tips: dict[tuple[int, int], dict[str, str]] = {}  # (fragment, version) -> peer id -> tip checksum
        digests: dict[tuple[int, ...], dict[str, str]] = {}  # versions -> peer id -> digest reported there

        def agree(where: object, reported: dict[str, str]) -> None:
            assert len(set(reported.values())) == 1, (
                f"honest replicas diverged at {where}: { {pid[:12]: d for pid, d in reported.items()} }"
            )

        def every_fragment_met(status: dict) -> bool:
            for pid, p in self.honest(status).items():
                if pid not in ids or not p["versions"]:
                    continue
                digests.setdefault(tuple(p["versions"]), {})[pid] = p["digest"]
                agree(f"versions {tuple(p['versions'])}", digests[tuple(p["versions"])])
                for i, (version, tip) in enumerate(zip(p["versions"], p["tips"])):
                    tips.setdefault((i, version), {})[pid] = tip[1]
                    agree(f"fragment {i} version {version}", tips[(i, version)])
            met = {i for (i, _), seen in tips.items() if set(seen) == ids}
            return met == set(range(self.manifest.diloco.fragments))

        try:
            return self.wait_status(
                every_fragment_met, ADVANCE_TIMEOUT, "the honest peers at one same version"
            )
        except AssertionError as exc:
            last = {
                pid[:12]: sorted(v for v, seen in digests.items() if pid in seen)[-6:] for pid in sorted(ids)
            }
            raise AssertionError(f"{exc}\nthe last versions each honest peer was seen at: {last}") from exc

    def wait_ticks(self, since: float, n: int = 2) -> dict:
        """Until every honest peer wrote a heartbeat at least `n - 1` periods after DHT time `since`: each
        swarm tick writes the heartbeat, then reads the swarm, so by then every peer has read what was
        stored before `since` (a forged record, say) at least once."""
        timing = self.manifest.timing
        due = since + (n - 1) * timing.heartbeat_period

        def ticked(status: dict) -> bool:
            honest = self.honest(status)
            written = [status["time"] + p["expires_in"] - timing.heartbeat_ttl for p in honest.values()]
            return len(honest) == len(self.peers) and min(written) >= due

        return self.wait_status(ticked, 30, f"every honest peer to tick {n} times after the forged record")

    def assert_never_synchronizer(self, *rogues: Rogue) -> None:
        """`swarm_status` (what `p2p-diloco status` prints) never named a rogue as synchronizer (of any
        shard)."""
        bad = {r.peer_id for r in rogues}
        held = [
            sync
            for s in self.seen
            for sync in [s["synchronizer"], *(row["synchronizer"] for row in s.get("shards", []))]
            if sync and sync["peer_id"] in bad
        ]
        assert not held, f"`status` showed a rogue as synchronizer ({len(held)} reads): {held[:2]}"

    def assert_honest_holder(self, status: dict) -> None:
        """The honest peers' own view: one of them says it synchronizes (heartbeat role)."""
        roles = {p["peer_id"][:12]: p["role"] for p in self.honest(status).values()}
        assert "synchronizer" in roles.values(), f"no honest peer holds the lease: {roles}"

    def assert_terms_not_adopted(self, status: dict, forged_term: int) -> None:
        terms = {
            p["peer_id"][:12]: max([p["term_seen"], *p["shard_terms"]]) for p in self.honest(status).values()
        }
        assert all(t < forged_term for t in terms.values()), (
            f"honest peers adopted the forged term {forged_term}: {terms}"
        )

    def rejections(self, status: dict) -> dict[str, int]:
        total: dict[str, int] = {}
        for p in self.honest(status).values():
            for tag, n in p["rejections"].items():
                total[tag] = total.get(tag, 0) + n
        return total

    def wait_rejected(self, reasons: set[str], what: str) -> dict:
        """Wait until some honest peer's status counts one of `reasons`."""
        return self.wait_status(
            lambda s: reasons & set(self.rejections(s)),
            30,
            f"{what}: one of {sorted(reasons)} in the rejections",
        )

    def eval_losses(self) -> dict[str, float]:
        """Held-out eval loss of each honest peer's persisted replica (``replica.pt``, saved every second)."""
        model = build_model(self.manifest.model)
        plan = plan_fragments(
            [(n, tuple(p.shape)) for n, p in model.named_parameters()],
            self.manifest.diloco.fragments,
            self.manifest.diloco.fragment_pattern,
        )
        corpus = _corpus(self.manifest)
        losses = {}
        for name, joined in self.peers.items():
            replica = None
            for _ in range(20):  # between the rename and a concurrent read a save can be missed: retry
                try:
                    replica = load_replica(joined.state_dir / REPLICA_DIR, plan)
                    break
                except ReplicaFileError:
                    time.sleep(0.2)
            assert replica is not None, f"{name}: no readable replica.pt"
            params = replica.export_params()
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(params[n])
            losses[name] = evaluate(
                model, corpus.eval, block_size=self.manifest.model.block_size, max_batches=4
            )
        return losses

    def assert_loss_not_risen(self, before: dict[str, float]) -> None:
        after = self.eval_losses()
        print(
            f"measured: eval loss (before, after): { {n: (round(before[n], 3), round(after[n], 3)) for n in before} }"
        )
        model = build_model(self.manifest.model)  # the seeded initial weights
        untrained = evaluate(
            model, _corpus(self.manifest).eval, block_size=self.manifest.model.block_size, max_batches=4
        )
        worse = {n: loss for n, loss in after.items() if not loss < untrained + LOSS_SLACK}
        assert not worse, f"global model worse than the untrained one ({untrained:.3f}): {worse}"

    def notes(self, name: str) -> list[str]:
        return [e.get("line", "") for e in read_events(self.peers[name].state_dir) if e["event"] == "note"]

    # ---- more honest peers ------------------------------------------------------------------------

    def join(self, name: str, *extra: str) -> Honest:
        key = self.tmp / f"{name}.key"
        peer_id = write_identity(key)
        state_dir = self.tmp / f"state-{name}"
        cmd = self.cli(
            "join", str(self.manifest_path), "--initial-peers", *self.bootstrap.addresses,
            "--identity", str(key), "--state-dir", str(state_dir), "--listen", LOOPBACK_LISTEN,
            "--min-step-time", "0.1", "--persist-every", "1", "--progress-every", "5", *extra,
        )  # fmt: skip
        joined = Honest(name, self.spawn(cmd), state_dir, peer_id)
        self.peers[name] = joined
        return joined


_CORPORA: dict[str, object] = {}


def _corpus(manifest: RunManifest):  # noqa: ANN202
    key = repr(manifest.data)
    if key not in _CORPORA:
        _CORPORA[key] = load_corpus(manifest.data)
    return _CORPORA[key]


@pytest.fixture(scope="module")
def rogue_keys(module_dht_peers, bootstrap_node, tmp_path_factory) -> RogueKeys:
    folder = tmp_path_factory.mktemp("rogues")
    peers = {}
    for name in ("stranger", "insider"):
        key = folder / f"{name}.key"
        write_identity(key)
        peers[name] = module_dht_peers(initial_peers=bootstrap_node.addresses, identity_path=key)
    return RogueKeys(**peers, folder=folder)


@pytest.fixture(scope="module")
def observer(module_dht_peers, bootstrap_node):  # noqa: ANN201
    return module_dht_peers(initial_peers=bootstrap_node.addresses, client_mode=True)


@pytest.fixture
def hostile_run(request, spawn, cli, wait_for, bootstrap_node, rogue_keys, observer, tmp_path):  # noqa: ANN001
    """A fresh public run (its own run ID) with two honest synchronizers training, and both rogues."""
    honest_keys = {}
    for name in ("a", "b"):
        key = tmp_path / f"{name}.key"
        honest_keys[name] = (key, write_identity(key))
    authority = honest_keys["a"][1]
    listed = [honest_keys["a"][1], honest_keys["b"][1], rogue_keys.insider.peer_id]
    run_id = "hostile-" + request.node.name.split("[")[0].removeprefix("test_")[:40].replace("_", "-")
    diloco = {"inner_steps": INNER_STEPS, **getattr(request, "param", {})}  # indirect: e.g. SHARDED
    run_id += f"-s{diloco.get('synchronizer_shards', 1)}"  # one test at two sizes: two runs
    path = tmp_path / "public.toml"
    trust = {"authority": authority, "synchronizers": listed, "learners": "any"}
    path.write_text(tiny_swarm_toml(run_id, diloco=diloco, trust=trust))
    sign_manifest(path, honest_keys["a"][0])  # `p2p-diloco manifest sign`: joins refuse it unsigned
    manifest = load_run_manifest(path)
    run = HostileRun(
        manifest=manifest,
        manifest_path=path,
        peers={},
        kv=DhtKeyValueStore(observer, timeout=5.0),
        spawn=spawn,
        cli=cli,
        bootstrap=bootstrap_node,
        tmp=tmp_path,
        wait_for=wait_for,
    )
    for name, (key, peer_id) in honest_keys.items():
        state_dir = tmp_path / f"state-{name}"
        cmd = cli(
            "join", str(path), "--initial-peers", *bootstrap_node.addresses,
            "--identity", str(key), "--state-dir", str(state_dir), "--listen", LOOPBACK_LISTEN,
            "--min-step-time", "0.1", "--persist-every", "1", "--progress-every", "5",
        )  # fmt: skip
        run.peers[name] = Honest(name, spawn(cmd), state_dir, peer_id)
    run.rogues = {
        name: Rogue(manifest, getattr(rogue_keys, name), key_path=rogue_keys.key(name))
        for name in ("stranger", "insider")
    }
    try:
        run.wait_status(run.ready, START_TIMEOUT, "two honest peers training under an honest synchronizer")
        yield run
    finally:
        for rogue in run.rogues.values():
            rogue.close()


def report(run: HostileRun, what: str, status: dict) -> None:
    """A ``measured:`` line with what the honest peers counted (run with -s to see it)."""
    by_sender = [row for p in run.honest(status).values() for row in p["rejections_by_sender"]]
    print(f"measured: {what}: rejections {run.rejections(status)}; by sender {by_sender}")


# ---- row 1: a lease from the future, then a destructive update ----------------------------------------


@pytest.mark.parametrize("who", ["stranger", "insider"])
def test_row1_future_lease_and_destructive_update_are_refused(hostile_run: HostileRun, who: str):
    run = hostile_run
    rogue = run.rogues[who]
    before = run.wait_status(run.ready, 30, "a ready swarm")
    losses = run.eval_losses()
    forged_term = max(row["term"] for row in synchronizer_rows(before)) + 1000  # above every shard's
    forged_at = rogue.now()
    rogue.forge_lease(forged_term, expires_at=forged_at + 3600)
    run.wait_for(rogue.lease_visible, 20, "the forged lease to be visible in the DHT")
    run.wait_ticks(forged_at)  # every honest peer has read it before the update arrives
    replies = {
        name: rogue.push_destructive_update(joined.peer_id, forged_term) for name, joined in run.peers.items()
    }
    print(f"measured: destructive update replies: { {n: [str(r) for r in rs] for n, rs in replies.items()} }")
    for name, rs in replies.items():
        assert not any(r.tag == "applied" for r in rs), f"{name} applied the rogue's update: {rs}"
    after = run.wait_advanced(before)
    run.wait_agreeing()
    run.assert_terms_not_adopted(after, forged_term)
    run.assert_honest_holder(after)
    run.assert_loss_not_risen(losses)
    reasons = REASONS["stranger lease" if who == "stranger" else "insider future lease"]
    rejected = run.wait_rejected(reasons, f"the {who}'s forged lease")
    run.wait_rejected(REASONS["rogue update"], f"the {who}'s update")
    run.assert_never_synchronizer(rogue)
    report(run, f"row 1 ({who})", rejected)


def test_row1_early_claim_of_the_next_term_is_refused(hostile_run: HostileRun):
    """The insider (a listed synchronizer) claims term T + 1 while the honest holder's term T is live."""
    run = hostile_run
    rogue = run.rogues["insider"]
    before = run.wait_status(run.ready, 30, "a ready swarm")
    term = before["synchronizer"]["term"]
    ttl = run.manifest.timing.lease_ttl
    forged_at = rogue.now()
    with rogue.sustain(lambda: rogue.forge_lease(term + 1, rogue.now() + ttl), period=ttl / 3):
        run.wait_ticks(forged_at)  # every honest peer has read the early claim
        replies = {n: rogue.push_destructive_update(j.peer_id, term + 1) for n, j in run.peers.items()}
        print(
            f"measured: early-claim update replies: { {n: [str(r) for r in rs] for n, rs in replies.items()} }"
        )
        for name, rs in replies.items():
            assert not any(r.tag == "applied" for r in rs), f"{name} applied the rogue's update: {rs}"
        during = run.wait_advanced(before)
        holder = run.honest(during)[before["synchronizer"]["peer_id"]]
        assert holder["role"] == "synchronizer", f"the honest holder was deposed: {holder['decisions']}"
        run.assert_terms_not_adopted(during, term + 1)
        rejected = run.wait_rejected(REASONS["insider early claim"], "the insider's early claim")
    run.wait_agreeing()
    run.assert_never_synchronizer(rogue)
    report(run, "row 1 (early claim)", rejected)


def test_row1_term_jump_backed_by_a_strangers_heartbeat_is_refused(hostile_run: HostileRun):
    """Collusion: the insider writes term T + 1000 with an honest-looking expiry (renewed like a holder's),
    while the stranger's heartbeat reports term_seen = T + 1000, as a peer back from a partition would.
    A stranger's self-report must not vouch for the jump."""
    run = hostile_run
    insider, stranger = run.rogues["insider"], run.rogues["stranger"]
    before = run.wait_status(run.ready, 30, "a ready swarm")
    losses = run.eval_losses()
    forged_term = before["synchronizer"]["term"] + 1000
    ttl = run.manifest.timing.lease_ttl
    versions = run.floor(before)
    forged_at = insider.now()

    def collude() -> None:
        insider.forge_lease(forged_term, insider.now() + ttl)
        stranger.forge_heartbeat(versions, forged_term, may_sync=False)

    with insider.sustain(collude, period=run.manifest.timing.heartbeat_period):
        run.wait_ticks(forged_at)
        replies = {n: insider.push_destructive_update(j.peer_id, forged_term) for n, j in run.peers.items()}
        print(
            f"measured: collusion update replies: { {n: [str(r) for r in rs] for n, rs in replies.items()} }"
        )
        for name, rs in replies.items():
            assert not any(r.tag == "applied" for r in rs), f"{name} applied the insider's update: {rs}"
        during = run.wait_advanced(before)
        run.assert_terms_not_adopted(during, forged_term)
        run.assert_honest_holder(during)
        rejected = run.wait_rejected(REASONS["insider future lease"], "the insider's term jump")
    run.wait_agreeing()
    run.assert_loss_not_risen(losses)
    run.assert_never_synchronizer(insider, stranger)
    report(run, "row 1 (collusion)", rejected)


def synchronizer_rows(status: dict) -> list[dict]:
    """The synchronizer of every shard that has one (one row at S = 1)."""
    rows = [row["synchronizer"] for row in status.get("shards", []) if row["synchronizer"]]
    return rows or [status["synchronizer"]]


def shard_holders(run: HostileRun, status: dict) -> dict[int, dict]:
    """shard -> its synchronizer row, for every shard an honest peer holds."""
    return {
        row["shard"]: row["synchronizer"]
        for row in status["shards"]
        if row["synchronizer"] and row["synchronizer"]["peer_id"] in run.honest(status)
    }


@pytest.mark.parametrize("hostile_run", [SHARDED], indirect=True, ids=["S4"])
def test_row1_sharded_future_lease_of_one_shard_vouches_for_no_update(hostile_run: HostileRun):
    """S = 4: the insider (a listed synchronizer) writes a lease 1000 terms ahead for shard 1 only, then
    pushes destructive updates under that term: of fragment 1 (shard 1's) and of fragment 2 (shard 2's,
    which no lease of shard 1 covers). All refused; shard 1 keeps an honest holder below the forged term;
    no honest peer adopts it for any shard; every fragment advances and the replicas agree."""
    run = hostile_run
    rogue = run.rogues["insider"]
    shard = 1
    before = run.wait_status(
        lambda s: run.ready(s) and len(shard_holders(run, s)) == SHARDED["synchronizer_shards"],
        60,
        "every shard held by an honest peer",
    )
    losses = run.eval_losses()
    forged_term = shard_holders(run, before)[shard]["term"] + 1000
    forged_at = rogue.now()
    rogue.forge_lease(forged_term, expires_at=forged_at + 3600, shard=shard)
    run.wait_for(lambda: rogue.lease_visible(shard), 20, "the forged shard lease to be visible in the DHT")
    run.wait_ticks(forged_at)  # every honest peer has read it before the updates arrive
    replies = {
        (name, fragment): rogue.push_destructive_update(joined.peer_id, forged_term, fragment)
        for name, joined in run.peers.items()
        for fragment in (1, 2)
    }
    print(f"measured: sharded update replies: { {k: [str(r) for r in rs] for k, rs in replies.items()} }")
    for key, rs in replies.items():
        assert not any(r.tag == "applied" for r in rs), f"{key} applied the rogue's update: {rs}"
    after = run.wait_advanced(before)
    run.wait_agreeing()
    held = shard_holders(run, after).get(shard)
    assert held is not None and held["term"] < forged_term, (
        f"shard {shard} lost its honest holder: {after['shards']}"
    )
    seen = {pid[:12]: [p["term_seen"], *p["shard_terms"]] for pid, p in run.honest(after).items()}
    assert all(max(terms) < forged_term for terms in seen.values()), (forged_term, seen)
    run.assert_loss_not_risen(losses)
    rejected = run.wait_rejected(REASONS["insider future lease"], "the insider's forged shard lease")
    run.wait_rejected(REASONS["rogue update"], "the insider's updates")
    run.assert_never_synchronizer(rogue)
    report(run, "row 1 (S = 4)", rejected)


# ---- row 2: an already-expired lease of the current term, then an update -------------------------------


@pytest.mark.parametrize(
    ("hostile_run", "who"),
    [({}, "stranger"), ({}, "insider"), (SHARDED, "insider")],  # at S = 4 the listed key only: CI time
    indirect=["hostile_run"],
    ids=["S1-stranger", "S1-insider", "S4-insider"],
)
def test_row2_expired_lease_then_update_is_refused(hostile_run: HostileRun, who: str):
    run = hostile_run
    rogue = run.rogues[who]
    before = run.wait_status(run.ready, 30, "a ready swarm")
    losses = run.eval_losses()
    term = before["synchronizer"]["term"]
    forged_at = rogue.now()
    rogue.forge_expired_lease(term)
    run.wait_for(rogue.lease_visible, 20, "the expired lease to be visible in the DHT")
    run.wait_ticks(forged_at)  # every honest peer has read it before the update arrives
    holder = before["synchronizer"]["peer_id"]
    replies = {
        name: rogue.push_destructive_update(joined.peer_id, term) for name, joined in run.peers.items()
    }
    print(
        f"measured: update replies (holder {holder[:12]}): { {n: [str(r) for r in rs] for n, rs in replies.items()} }"
    )
    for name, rs in replies.items():
        assert not any(r.tag == "applied" for r in rs), f"{name} applied the rogue's update: {rs}"
    run.wait_advanced(before)
    run.wait_agreeing()
    run.assert_loss_not_risen(losses)
    rejected = run.wait_rejected(REASONS["rogue update"], f"the {who}'s update")
    run.assert_never_synchronizer(rogue)
    report(run, f"row 2 ({who})", rejected)


# ---- row 3: deltas toward the initial weights with inflated claims ----------------------------------


def test_row3_revert_deltas_with_inflated_claims_weigh_no_more_than_an_honest_learner(
    hostile_run: HostileRun,
):
    """Two waves to the holder, each claiming 10^6 steps with matching tokens: copies of the latest merged
    update on an anchor a few versions old (they pass every content screen: the claim alone must not buy
    more merge weight than an honest learner's H steps), then deltas back toward the initial weights at an
    honest norm (the direction screen of public runs refuses most; a merged one is capped the same way)."""
    run = hostile_run
    rogue = run.rogues["stranger"]
    before = run.wait_status(lambda s: run.ready(s, at_least=3), 60, "a swarm with a few merged updates")
    losses = run.eval_losses()
    holder = before["synchronizer"]["peer_id"]
    source = next(j.peer_id for j in run.peers.values() if j.peer_id != holder)
    stale = run.manifest.diloco.max_staleness - 1  # an anchor the holder still accepts
    inflated = rogue.send_inflated_deltas(holder, source, rounds=4, steps=10**6, stale=stale)
    revert = rogue.send_revert_deltas(holder, source, rounds=4, steps=10**6)
    print(f"measured: revert delta replies: {[(f, str(r)[:80]) for f, r in revert]}")
    print(f"measured: inflated-claim delta replies: {[(f, str(r)[:80]) for f, r in inflated]}")
    after = run.wait_advanced(before)
    run.wait_agreeing()
    run.assert_never_synchronizer(rogue)
    # merge weight = tokens^2 / steps: for an honest learner's H steps of the manifest's batch, H * per_step^2
    per_step = run.manifest.diloco.batch_size * run.manifest.model.block_size
    honest_cap = INNER_STEPS * per_step * per_step
    holder_name = next(n for n, j in run.peers.items() if j.peer_id == holder)
    entries = read_ledger(run.peers[holder_name].state_dir)
    weights = [w for e in entries for peer, w, _ in e.contributors if peer == rogue.peer_id]
    honest = [w for e in entries for peer, w, _ in e.contributors if peer != rogue.peer_id]
    print(
        f"measured: rogue merged in {len(weights)} updates, weights {weights[:6]} "
        f"(x{max(weights, default=0) / honest_cap:.1f} of H steps); honest max {max(honest, default=0)}"
    )
    assert all(w <= honest_cap * 1.01 for w in weights), (
        f"a 10^6-step claim weighed {max(weights)} = {max(weights) / honest_cap:.1f} x an honest learner's H steps"
    )
    for fragment, reply in (
        revert + inflated
    ):  # each delta either merged (weight checked) or refused with a reason
        assert reply.tag in ("accepted",) or reply.reason, (fragment, reply)
    run.assert_loss_not_risen(losses)
    report(run, "row 3", after)


# ---- row 4: a forged heartbeat ----------------------------------------------------------------------


@BOTH_SIZES
def test_row4_forged_heartbeat_neither_deposes_the_holder_nor_halts_training(hostile_run: HostileRun):
    run = hostile_run
    rogue = run.rogues["stranger"]
    before = run.wait_status(run.ready, 30, "a ready swarm")
    forged_term = max(row["term"] for row in synchronizer_rows(before)) + 1000  # above every shard's
    versions = tuple(v + 1000 for v in run.floor(before))
    period = run.manifest.timing.heartbeat_period
    with rogue.sustain(lambda: rogue.forge_heartbeat(versions, forged_term, may_sync=True), period=period):
        run.wait_status(
            lambda s: any(p["peer_id"] == rogue.peer_id for p in s["peers"]),
            20,
            "the forged heartbeat to be visible",
        )
        # training goes on while the forged heartbeat is live: the holder keeps its term, honest peers stay
        # eligible, updates keep coming
        during = run.wait_advanced(before)
        assert during["synchronizer"] is not None and during["synchronizer"]["peer_id"] in run.honest(
            during
        ), during["synchronizer"]
        assert during["synchronizer"]["term"] < forged_term
        run.assert_terms_not_adopted(during, forged_term)
    run.wait_agreeing()
    decisions = [line for p in run.honest(during).values() for line in p["decisions"]]
    assert not any("not eligible" in line and "lags" in line for line in decisions), decisions
    # No rejection reason to check: a heartbeat is a self-report that honest peers never act on (its term
    # is not adopted, its versions do not count for eligibility), so nothing is refused and counted.
    run.assert_never_synchronizer(rogue)
    report(run, "row 4", during)


# ---- row 5: a forged branch tip and a poisoned snapshot ------------------------------------------------


def test_row5_forged_tip_and_poisoned_snapshot_are_not_adopted_by_replicas_or_a_newcomer(
    hostile_run: HostileRun,
):
    run = hostile_run
    rogue = run.rogues["stranger"]
    before = run.wait_status(run.ready, 30, "a ready swarm")
    losses = run.eval_losses()
    term = before["synchronizer"]["term"]
    period = run.manifest.timing.heartbeat_period
    poisoned: dict[int, str] = {}  # version -> checksum prefix of the random-weight fragment 0 served at it
    lock = threading.Lock()  # `poisoned` grows on the rogue's sustain thread
    ids = {j.peer_id for j in run.peers.values()}

    def forge_tip() -> None:
        """Keep a tip for fragment 0 five versions ahead of the honest ones (same term), random weights behind."""
        beats = {p: b for p, b in rogue.heartbeats().items() if p in ids and b.tips}
        if not beats:
            return
        honest_beat = max(beats.values(), key=lambda b: b.versions[0])
        version = honest_beat.versions[0] + 5
        if version not in poisoned:
            checksum = rogue.serve_poisoned_snapshot(0, version)[:16]
            with lock:
                poisoned[version] = checksum
        versions = (version, *honest_beat.versions[1:])
        rogue.forge_heartbeat(versions, term, tips=((term, poisoned[version]), *honest_beat.tips[1:]))

    seen: set[str] = set()

    def poisoned_now(status: dict) -> bool:
        """Records honest peers whose fragment 0 is the rogue's (their published tip checksum)."""
        with lock:
            bad = set(poisoned.values())
        for pid, beat in rogue.heartbeats().items():
            if pid in run.honest(status) and beat.tips and beat.tips[0][1] in bad:
                seen.add(pid[:12])
        return bool(seen)

    with rogue.sustain(forge_tip, period=period):
        run.wait_status(
            lambda s: any(p["peer_id"] == rogue.peer_id for p in s["peers"]),
            20,
            "the forged tip to be visible",
        )
        newcomer = run.join("newcomer", "--no-sync")
        ids.add(newcomer.peer_id)
        start = min(run.floor(before))
        run.wait_status(
            lambda s: (
                poisoned_now(s) or (newcomer.peer_id in run.honest(s) and min(run.floor(s)) > start + ADVANCE)
            ),
            ADVANCE_TIMEOUT,
            "the newcomer to join and every honest replica to advance (or to be poisoned)",
        )
        assert not seen, f"replicas took the poisoned fragment 0: {sorted(seen)}"
        run.wait_agreeing()
    loaded = {
        name: [
            line
            for line in run.notes(name)
            if rogue.peer_id in line and ("loaded" in line or "reconciled" in line)
        ]
        for name in run.peers
    }
    assert not any(loaded.values()), f"peers loaded a fragment from the rogue: {loaded}"
    served = rogue.snapshots_served
    print(f"measured: poisoned snapshots served to {served}; forged versions {sorted(poisoned)}")
    if served:  # whoever downloaded the rogue's snapshot refused it, with its reason
        run.wait_rejected(REASONS["poisoned snapshot"], "the poisoned snapshot")
    del run.peers["newcomer"]  # its replica started at the initial weights: not part of the loss check
    run.assert_loss_not_risen(losses)
    run.assert_never_synchronizer(rogue)
    report(run, "row 5", run.status())


# ---- row 6: idle streams claiming 200 MiB ------------------------------------------------------------


def test_row6_idle_streams_claiming_200_mib_do_not_stall_updates_or_deltas(hostile_run: HostileRun):
    run = hostile_run
    rogue = run.rogues["stranger"]
    before = run.wait_status(run.ready, 30, "a ready swarm")
    holder = before["synchronizer"]["peer_id"]
    follower = next(n for n, j in run.peers.items() if j.peer_id != holder)
    applied_before = run.honest(before)[run.peers[follower].peer_id]["updates_applied"]
    opened = {name: rogue.hold_idle_streams(j.peer_id, 8, 200 * 1024 * 1024) for name, j in run.peers.items()}
    print(f"measured: idle streams opened: {opened}")
    try:
        t0 = time.monotonic()
        held = run.status()  # the baseline once every stream is held
        during = run.wait_advanced(held)  # while the rogue holds its streams
        follower_now = run.honest(during)[run.peers[follower].peer_id]
        assert follower_now["updates_applied"] > applied_before, "the follower applied no update"
        age = follower_now["last_contribution_age"]
        assert age is not None and age < 30, f"the follower's deltas stopped merging ({age} s ago)"
        print(
            f"measured: {ADVANCE} versions per fragment in {time.monotonic() - t0:.1f} s under 16 idle streams"
        )
    finally:
        rogue.release_streams()
    run.wait_agreeing()
    rejected = run.wait_rejected(REASONS["idle streams"], "the idle streams")
    run.assert_never_synchronizer(rogue)
    report(run, "row 6", rejected)
