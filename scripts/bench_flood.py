#!/usr/bin/env python
"""Flood benchmark (issue #27): a 3-peer public run on 127.0.0.1, quiet and under a Sybil flood.

    .venv/bin/python scripts/bench_flood.py --out DIR [--sybils 200] [--window 90] [--settle 30]

Each run: a bootstrap node and three `join` processes (two listed `[trust] synchronizers`, one learner
that no list names, `learners = "any"`) of a signed public manifest with the default `[timing]` (1 s
heartbeats, 6 s leases; no rotation), steps paced with `--min-step-time`.
The flooded run adds `--sybils` fresh keys (RSA keys made here, unknown to the manifest), each key signing
its own records: every 5 s a heartbeat claiming versions 10^6, `may_sync`, term_seen 1000 and a forged
branch tip (so every key stays live); every minute a lease of term 1000 expiring an hour ahead naming
itself successor, and a dedicated eval history dated a day ahead. The records are written through
`--flood-nodes` DHT nodes of this process (their CPU is the attacker's, here on the honest peers' cores).

After `--settle` seconds (startup, first leases) it measures for `--window` seconds: versions/s (the sum of
fragment versions the listed synchronizers report, by `p2p-diloco status`'s reader), and reads the peers'
event logs for double claims (two peers that claimed the same term). Every few seconds it records what
`status` shows: its synchronizer, live peers, fragment versions. Writes DIR/flood.json and DIR/flood.png.
Goal (reported, not asserted): versions/s under the flood >= 0.5 x the quiet run, no double claim, and
`status` names a listed synchronizer with versions no higher than the honest peers'.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from functools import partial
from pathlib import Path

from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.config import RunManifest
from p2p_diloco.net.dht_store import DhtKeyValueStore, create_dht
from p2p_diloco.net.identity import write_identity
from p2p_diloco.net.manifest_signature import sign_manifest
from p2p_diloco.node.state import read_events
from p2p_diloco.node.status import swarm_status
from p2p_diloco.protocol.election import LeaseRecord
from p2p_diloco.wire.keys import eval_key, heartbeat_key, lease_key
from p2p_diloco.wire.observe import EvalHistory, EvalPoint
from p2p_diloco.wire.records import HeartbeatInfo, encode_lease

ROOT = Path(__file__).resolve().parent.parent
# Seconds between two writes of a Sybil key's heartbeat (it lives twice that): every key stays live, at a
# rate that is the attacker's CPU here, not the honest peers' (they share these 2 cores).
REWRITE = 5.0
LISTEN = "/ip4/127.0.0.1/tcp/0"
MANIFEST = """run_id = "{run_id}"
[diloco]
inner_steps = 8
fragments = 2
max_in_flight = 2
min_quorum = 1
[model]
n_layer = 1
n_head = 2
n_embd = 32
block_size = 32
[timing]
term_rounds = 1000
[trust]
authority = "{a}"
synchronizers = ["{a}", "{b}"]
learners = "any"
"""


class SybilSigner(RecordValidatorBase):
    """Signs each record whose subkey is one of the Sybil keys' owner tags with that key, as hivemind's
    `RSASignatureValidator` signs a node's own: so one DHT node writes as many owners as it has keys, and
    every other node checks each record against its owner's key as usual."""

    def __init__(self, keys: list[RSAPrivateKey]):
        self.tags = {
            b"[owner:" + key.get_public_key().to_bytes() + b"]": key for key in keys
        }  # the format of RSASignatureValidator.PUBLIC_KEY_FORMAT

    def validate(self, record: DHTRecord) -> bool:
        return True  # the node's RSASignatureValidator checks the signature

    def sign_value(self, record: DHTRecord) -> bytes:
        key = next((key for tag, key in self.tags.items() if tag in record.subkey), None)
        if key is None:
            return record.value
        signature = key.sign(MSGPackSerializer.dumps(dataclasses.astuple(record)))
        return record.value + b"[signature:" + signature + b"]"

    def strip_value(self, record: DHTRecord) -> bytes:
        return record.value  # the node's RSASignatureValidator strips the signature

    @property
    def priority(self) -> int:
        return 11  # signs after the node's own validator (10), which leaves others' records alone


_SYBIL_TAGS: dict[int, list[bytes]] = {}  # flood node -> its keys' owner tags (set before its DHT forks)


async def _flood_round(index, writes, dht, node):  # noqa: ANN001, ANN202
    """Runs in a flood node's DHT process (`DHT.run_coroutine`): each write under every Sybil key's subkey."""
    tags = _SYBIL_TAGS[index]
    keys, values, expirations, subkeys = [], [], [], []
    for key, value, expiration in writes:
        keys += [key] * len(tags)
        values += [value] * len(tags)
        expirations += [expiration] * len(tags)
        subkeys += tags
    return await node.store_many(keys, values, expirations, subkeys=subkeys)


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "p2p_diloco.cli", *args]


class Run:
    def __init__(self, folder: Path, sybils: int, run_id: str):
        self.folder, self.sybils = folder, sybils
        folder.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.keys = {name: folder / f"{name}.key" for name in ("a", "b", "c", "boot")}
        self.ids = {name: write_identity(path, force=True) for name, path in self.keys.items()}
        self.manifest_path = folder / "run.toml"
        self.manifest_path.write_text(MANIFEST.format(run_id=run_id, a=self.ids["a"], b=self.ids["b"]))
        sign_manifest(self.manifest_path, self.keys["a"])
        self.manifest = RunManifest.load(self.manifest_path)
        self.stop = threading.Event()
        self.samples: list[dict] = []
        self.flood_writes = 0
        self.flood_nodes: list = []

    def spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.folder / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            args,
            stdout=subprocess.PIPE if name == "boot" else log,
            stderr=log,
            cwd=ROOT,
            start_new_session=True,
        )
        self.procs[name] = proc
        return proc

    def start(self) -> list[str]:
        boot = self.spawn("boot", cli("bootstrap", "--identity", str(self.keys["boot"]), "--listen", LISTEN))
        addresses: list[str] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not addresses:
            line = boot.stdout.readline().decode()
            if line.startswith("bootstrap address: "):
                addresses.append(line.removeprefix("bootstrap address: ").strip())
        if not addresses:
            raise RuntimeError("the bootstrap node printed no address")
        threading.Thread(target=lambda: boot.stdout.read(), daemon=True).start()
        for name in ("a", "b", "c"):
            args = [
                "join",
                str(self.manifest_path),
                "--initial-peers",
                *addresses,
                "--identity",
                str(self.keys[name]),
            ]
            args += [
                "--state-dir",
                str(self.folder / f"state-{name}"),
                "--listen",
                LISTEN,
                "--min-step-time",
                "0.2",
            ]
            self.spawn(name, cli(*args))
        return addresses

    def flood(self, addresses: list[str], nodes: int) -> None:
        """The Sybil keys' records, written through `nodes` DHT nodes (one thread each, its share of keys)."""
        keys = [RSAPrivateKey() for _ in range(self.sybils)]
        threads = [
            threading.Thread(target=self._flood_from, args=(addresses, keys[i::nodes], i), daemon=True)
            for i in range(nodes)
        ]
        for thread in threads:
            thread.start()

    def _flood_from(self, addresses: list[str], keys: list[RSAPrivateKey], index: int) -> None:
        signer = SybilSigner(keys)
        _SYBIL_TAGS[index] = list(signer.tags)  # read by `_flood_round` in the forked DHT process
        node = create_dht(initial_peers=addresses, host_maddrs=[LISTEN], extra_validators=[signer])
        self.flood_nodes.append(node)
        m = self.manifest
        hb, lease, ev = (f(m.run_id, m.manifest_hash) for f in (heartbeat_key, lease_key, eval_key))
        term, rounds = 1000, 0
        while not self.stop.is_set():
            started = time.monotonic()
            now = get_dht_time()
            info = HeartbeatInfo(
                role="synchronizer",
                may_sync=True,
                reachable=True,
                versions=(10**6, 10**6),
                term_seen=term,
                tips=((term, "f" * 16), (term, "f" * 16)),
            )
            writes = [(hb, info.to_bytes(), now + 2 * REWRITE)]
            if rounds % 12 == 0:  # leases (an hour) and eval records (a day) outlive many rounds
                point = EvalPoint(now + 86400, 10**12, (10**6, 10**6), 0.01, "sybil", term=term)
                writes.append((lease, encode_lease(LeaseRecord("sybil", term, now + 3600)), now + 3600))
                writes.append((ev, EvalHistory((point,), dedicated=True).to_bytes(), now + 86400))
            # the same value under every key's subkey, signed by each key in the DHT process: a small call
            # (hivemind's pipe to its DHT process breaks on large ones) and one traversal per DHT key
            node.dht.run_coroutine(partial(_flood_round, index, writes), return_future=True)
            self.flood_writes += len(writes) * len(keys)
            rounds += 1
            self.stop.wait(max(0.0, REWRITE - (time.monotonic() - started)))

    def observe(self, seconds: float, reader: DhtKeyValueStore) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                status = swarm_status(reader, self.manifest, get_dht_time())
            except TimeoutError:
                time.sleep(1.0)
                continue
            honest = {self.ids[n]: n for n in ("a", "b", "c")}
            mine = [p for p in status["peers"] if p["peer_id"] in honest]
            listed = [p for p in mine if p["listed"] and p["versions"]]
            sync = status["synchronizer"]
            self.samples.append(
                {
                    "t": time.monotonic(),
                    # None: this read held no listed synchronizer's heartbeat (a partial DHT answer)
                    "versions": sum(max(p["versions"][i] for p in listed) for i in range(2))
                    if listed
                    else None,
                    "status_versions": [f["version"] for f in status["fragments"]],
                    "status_peers": len(status["peers"]),
                    "status_synchronizer": honest.get(sync["peer_id"], "UNLISTED " + sync["peer_id"][:12])
                    if sync
                    else None,
                    "honest_versions": {honest[p["peer_id"]]: p["versions"] for p in mine},
                }
            )
            time.sleep(2.0)

    def claims(self) -> list[dict]:
        """Every claim the honest peers' event logs show: term, peer, reason."""
        found = []
        for name in ("a", "b", "c"):
            for event in read_events(self.folder / f"state-{name}"):
                if event.get("event") == "claim":
                    found.append(
                        {"term": int(event["term"]), "peer": name, "reason": event.get("reason", "")}
                    )
        return sorted(found, key=lambda c: (c["term"], c["peer"]))

    def double_claims(self) -> list[dict]:
        by_term: dict[int, set[str]] = {}
        for claim in self.claims():
            by_term.setdefault(claim["term"], set()).add(claim["peer"])
        return [{"term": t, "peers": sorted(p)} for t, p in sorted(by_term.items()) if len(p) > 1]

    def close(self) -> None:
        self.stop.set()
        for proc in self.procs.values():
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        for node in self.flood_nodes:
            node.shutdown()


def one_run(folder: Path, sybils: int, settle: float, window: float, nodes: int = 4) -> dict:
    run = Run(folder, sybils, run_id=f"flood-{sybils}-{int(time.time())}")
    try:
        addresses = run.start()
        observer = create_dht(initial_peers=addresses, client_mode=True)
        reader = DhtKeyValueStore(observer)
        if sybils:
            run.flood(addresses, nodes)
        run.observe(settle, reader)
        run.samples.clear()
        run.observe(window, reader)
        observer.shutdown()
    finally:
        run.close()
    samples = run.samples
    seen = [s for s in samples if s["versions"] is not None]
    rate = (
        (seen[-1]["versions"] - seen[0]["versions"]) / (seen[-1]["t"] - seen[0]["t"])
        if len(seen) > 1
        else 0.0
    )
    honest_max = max((max(v) for s in samples for v in s["honest_versions"].values() if v), default=0)
    return {
        "sybils": sybils,
        "versions_per_s": rate,
        "double_claims": run.double_claims(),
        "claims": run.claims(),
        "flood_writes": run.flood_writes,
        "status_synchronizers": dict(Counter(str(s["status_synchronizer"]) for s in samples)),
        "status_peers_max": max(s["status_peers"] for s in samples),
        "status_version_max": max(max(s["status_versions"]) for s in samples),
        "honest_version_max": honest_max,
        "samples": samples,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--sybils", type=int, default=200)
    parser.add_argument("--settle", type=float, default=30.0)
    parser.add_argument("--window", type=float, default=90.0)
    parser.add_argument("--work", help="folder for the runs' logs and state (default: a new temporary one)")
    parser.add_argument("--replot", action="store_true", help="redraw DIR/flood.png from DIR/flood.json")
    parser.add_argument("--flood-only", action="store_true", help="skip the quiet run (for debugging)")
    parser.add_argument("--flood-nodes", type=int, default=2, help="DHT nodes that write the Sybil records")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        result = json.loads((out / "flood.json").read_text())
        for run in ("quiet", "flood"):  # runs before None marked a read without listed peers wrote 0
            for sample in result[run]["samples"]:
                sample["versions"] = sample["versions"] or None
        plot(result, out / "flood.png")
        return 0
    runs = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench-flood-"))
    quiet = flood = None
    if not args.flood_only:
        quiet = one_run(runs / "quiet", 0, args.settle, args.window)
        print(f"quiet: {quiet['versions_per_s']:.2f} versions/s, double claims {quiet['double_claims']}")
    flood = one_run(runs / "flood", args.sybils, args.settle, args.window, args.flood_nodes)
    print(f"flood: {flood['versions_per_s']:.2f} versions/s, double claims {flood['double_claims']}")
    print(f"logs and state directories: {runs}", flush=True)
    if quiet is None:
        quiet = {"versions_per_s": 0.0, "double_claims": [], "samples": flood["samples"][:1]}
    ratio = flood["versions_per_s"] / quiet["versions_per_s"] if quiet["versions_per_s"] else 0.0
    result = {
        "command": " ".join(sys.argv),
        "quiet": quiet,
        "flood": flood,
        "ratio": ratio,
        "goal": "ratio >= 0.5, no double claim, status names a listed synchronizer and no version above the honest peers'",
        "met": ratio >= 0.5
        and not quiet["double_claims"]
        and not flood["double_claims"]
        and not any(k.startswith("UNLISTED") for k in flood["status_synchronizers"])
        and flood["status_version_max"] <= flood["honest_version_max"],
    }
    (out / "flood.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "flood.png")
    print(json.dumps({k: v for k, v in result.items() if k not in ("quiet", "flood")}, indent=1))
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name in ("quiet", "flood"):
        samples = result[name]["samples"]
        t0 = samples[0]["t"]
        seen = [s for s in samples if s["versions"] is not None]
        right.plot([s["t"] - t0 for s in seen], [s["versions"] for s in seen], label=name)
    right.set_xlabel("seconds into the window")
    right.set_ylabel("sum of fragment versions (listed synchronizers)")
    right.legend()
    rates = [result["quiet"]["versions_per_s"], result["flood"]["versions_per_s"]]
    left.bar(["quiet", f"{result['flood']['sybils']} Sybil keys"], rates, color=["tab:blue", "tab:red"])
    left.set_ylabel("versions / s")
    left.set_title(f"ratio {result['ratio']:.2f}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    raise SystemExit(main())
