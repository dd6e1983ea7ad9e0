"""`p2p-diloco status`: a passive DHT client that reads the swarm's heartbeats and leases and prints them.

It writes nothing (no heartbeat, no lease) and serves nothing, so it never takes part in elections or
receives updates. `swarm_status` turns what it reads into one JSON-ready dict; tests use it directly
on an in-process DHT peer.

With ``--state-dir DIR`` it adds the contribution ledger of that peer (`node.ledger`: accepted tokens,
merge weight and share per contributing peer, over every update that peer applied; key ``ledger`` in
``--json``). ``--ledger`` prints only that ledger, from the local files, without joining the DHT.

It never pretends: without a peer to ask (no ``--initial-peers``, none in the manifest) it refuses (exit
2), and when it saw no live peer it prints what it read and exits 1 with the reason. Raw unix times in
the peers' decision lines are printed as UTC clock times with their distance from now.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.config import RunManifest
from p2p_diloco.errors import ConfigError
from p2p_diloco.net.dht_store import DhtKeyValueStore, create_dht
from p2p_diloco.net.manifest_signature import load_run_manifest
from p2p_diloco.node.ledger import format_ledger, ledger_report, read_ledger
from p2p_diloco.protocol import election, heartbeat_buckets, lease_rules, shards
from p2p_diloco.wire.interfaces import KeyValueStore, StoredValue
from p2p_diloco.wire.keys import eval_key, heartbeat_key, lease_key
from p2p_diloco.wire.observe import (
    MAX_EVAL_SKEW,
    EvalHistory,
    admit_histories,
    decode_eval_history,
    merge_records,
)
from p2p_diloco.wire.records import HeartbeatInfo, RecordError, decode_heartbeat, decode_lease


def swarm_status(kv: KeyValueStore, manifest: RunManifest, now: float) -> dict[str, Any]:
    """The swarm as seen in the DHT at `now`: synchronizer, per-fragment versions, live peers, leases.

    ``synchronizer`` is the holder of the live lease with the highest term among the leases the run's lease
    rules accept (`screen_read`; the others are listed in ``refused_leases`` with their reason), None if
    no such lease is live;
    a fragment's version is the highest a live peer that may synchronize reports (``listed`` per peer: the
    fields of an unlisted peer are its own claims); ``ignored`` counts records that failed their schema
    check. ``shards`` lists each synchronizer shard (`protocol.shards`) with its fragments, holder and
    term; the top-level ``synchronizer``, ``highest_term`` and ``leases`` are shard 0's (with S = 1, the
    run's).
    """
    ignored: Counter[str] = Counter()
    peers = read_heartbeats(kv, manifest, now, ignored)
    count = manifest.diloco.synchronizer_shards
    read = [read_shard(kv, manifest, peers, shard, now, ignored) for shard in range(count)]
    leases, screened, valid, current = read[0]
    evaluation, eval_ignored = last_eval(kv, manifest, now)
    ignored.update(eval_ignored)
    return {
        "run_id": manifest.run_id,
        "manifest_hash": manifest.manifest_hash,
        "time": now,
        "synchronizer": holder_row(current, now),
        "highest_term": election.highest_term(valid),
        # the newest global evaluation: t, tokens, versions, updates, loss, perplexity, evaluator, term
        "eval": evaluation,
        "fragments": [{"index": i, "version": v} for i, v in enumerate(backed_versions(manifest, peers))],
        "peers": peers,
        "leases": lease_rows(leases, now),
        "refused_leases": [
            {"peer_id": lease.holder, "term": lease.term, "reason": tag} for lease, tag, _ in screened.refused
        ],
        "shards": shard_rows(manifest, read, now),
        "ignored": dict(ignored),
    }


def every_heartbeat(kv: KeyValueStore, manifest: RunManifest, now: float) -> dict[str, StoredValue]:
    """Every live peer's stored heartbeat, from every heartbeat bucket (`protocol.heartbeat_buckets`: one
    key below 16 shards): a one-shot look at the run reads them all, unlike a peer's bounded tick."""
    found: dict[str, StoredValue] = {}
    for bucket in range(heartbeat_buckets.buckets_for(manifest.diloco.synchronizer_shards)):
        found.update(kv.get(heartbeat_key(manifest.run_id, manifest.manifest_hash, bucket), now))
    return found


def read_heartbeats(
    kv: KeyValueStore, manifest: RunManifest, now: float, ignored: Counter[str]
) -> list[dict]:
    """One row per live peer's heartbeat (`heartbeat_row`), by peer ID; counts the undecodable in
    `ignored`."""
    peers = []
    for peer_id, stored in sorted(every_heartbeat(kv, manifest, now).items()):
        try:
            info = decode_heartbeat(stored.value, manifest.diloco.fragments)
        except RecordError:
            ignored["bad heartbeat"] += 1
            continue
        peers.append(heartbeat_row(manifest, peer_id, info, stored.expiration, now))
    return peers


def heartbeat_row(
    manifest: RunManifest, peer_id: str, info: HeartbeatInfo, expiration: float, now: float
) -> dict[str, Any]:
    """A peer's heartbeat as a status row; ``listed`` says whether its fields are backed or its own claims."""
    return {
        "peer_id": peer_id,
        "listed": manifest.may_synchronize(peer_id),  # else every field below is an unbacked claim
        "role": info.role,
        "may_sync": info.may_sync,
        "ranks": info.ranks,
        "digest": info.digest,
        "versions": list(info.versions),
        "tips": [list(tip) for tip in info.tips],  # per fragment: [term, checksum prefix]
        "step": info.step,
        "loss": info.loss,
        "tokens": info.tokens,
        "tokens_per_s": info.tokens_per_s,
        "step_time": info.step_time,
        "updates_applied": info.updates_applied,
        "term_seen": info.term_seen,
        "shard_terms": list(info.shard_terms),  # the terms seen of shards 1..S-1 (none when S = 1)
        "last_contribution_age": now - info.last_contribution if info.last_contribution > 0 else None,
        "rejections": dict(info.rejections),
        "rejections_by_sender": [list(row) for row in info.rejections_by_sender],
        "decisions": list(info.decisions),
        "expires_in": expiration - now,
    }


def backed_versions(manifest: RunManifest, peers: list[dict[str, Any]]) -> list[int]:
    """Each fragment's version as the run's trust chain backs it: the highest a peer that may synchronize
    reports (in a public run the listed synchronizers; in an open run every peer). What other keys report
    stays in their rows, marked `listed: false`, as claims."""
    return [
        max((p["versions"][i] for p in peers if p["versions"] and p["listed"]), default=0)
        for i in range(manifest.diloco.fragments)
    ]


def lease_rows(leases: list[election.LeaseRecord], now: float) -> list[dict[str, Any]]:
    """The leases as read, by term then holder."""
    return [
        {
            "peer_id": lease.holder,
            "term": lease.term,
            "expires_in": lease.expires_at - now,
            "rounds_done": lease.rounds_done,
            "released": lease.released,
        }
        for lease in sorted(leases, key=lambda x: (x.term, x.holder))
    ]


def shard_rows(manifest: RunManifest, read: list[tuple], now: float) -> list[dict[str, Any]]:
    """Per synchronizer shard (`read_shard`'s results, by shard): its fragments, live holder, highest term."""
    count, num_fragments = manifest.diloco.synchronizer_shards, manifest.diloco.fragments
    return [
        {
            "shard": shard,
            "fragments": list(shards.fragments_of(shard, count, num_fragments)),
            "synchronizer": holder_row(holder, now),
            "highest_term": election.highest_term(shard_valid),
        }
        for shard, (_, _, shard_valid, holder) in enumerate(read)
    ]


def holder_row(current: election.LeaseRecord | None, now: float) -> dict[str, Any] | None:
    if current is None:
        return None
    return {"peer_id": current.holder, "term": current.term, "expires_in": current.expires_at - now}


def read_shard(
    kv: KeyValueStore,
    manifest: RunManifest,
    peers: list[dict[str, Any]],
    shard: int,
    now: float,
    ignored: Counter[str],
) -> tuple[list[election.LeaseRecord], lease_rules.Screened, list[election.LeaseRecord], Any]:
    """One shard's lease records, as read, as screened, the valid ones and the live holder (or None)."""
    leases = []
    for holder, stored in kv.get(lease_key(manifest.run_id, manifest.manifest_hash, shard), now).items():
        try:
            leases.append(decode_lease(holder, stored.value))
        except RecordError:
            ignored["bad lease"] += 1
    screened = screen_read(leases, peers, manifest, now, shard)
    valid = [item.lease for item in screened.valid]
    return leases, screened, valid, election.current_holder(valid, now)


def eval_histories(
    kv: KeyValueStore, manifest: RunManifest, now: float
) -> tuple[dict[str, EvalHistory], Counter[str]]:
    """The evaluators' published histories that may count (`wire.observe.admit_histories`: permitted
    writers and evaluators, no point from the future), and the count of what was ignored, by reason."""
    ignored: Counter[str] = Counter()
    found = {}
    for writer, stored in kv.get(eval_key(manifest.run_id, manifest.manifest_hash), now).items():
        try:
            found[writer] = decode_eval_history(stored.value, manifest.diloco.fragments)
        except RecordError:
            ignored["bad eval history"] += 1
    admitted = admit_histories(found, may_evaluate=manifest.may_evaluate, now=now, max_skew=MAX_EVAL_SKEW)
    ignored.update(reason for _, reason, _ in admitted.refused)
    return admitted.records, ignored


def last_eval(
    kv: KeyValueStore, manifest: RunManifest, now: float
) -> tuple[dict[str, Any] | None, Counter[str]]:
    """The newest global evaluation the evaluators published (`EvalPoint.as_dict`), None before any."""
    records, ignored = eval_histories(kv, manifest, now)
    points = merge_records(records)
    return (points[-1].as_dict() if points else None), ignored


def term_of(peer: dict[str, Any], shard: int) -> int:
    """The term a peer's heartbeat row reports seeing for `shard`."""
    if shard == 0:
        return peer["term_seen"]
    terms = peer.get("shard_terms", [])
    return terms[shard - 1] if shard <= len(terms) else 0


def screen_read(
    leases: list[election.LeaseRecord],
    peers: list[dict[str, Any]],
    manifest: RunManifest,
    now: float,
    shard: int = 0,
) -> lease_rules.Screened:
    """The lease rules every peer applies (`protocol.lease_rules`), on one read by a passive observer: every
    record first seen now, and the trusted term the one at least two live peers that may synchronize report
    (a forged heartbeat, or a thousand of fresh keys, cannot raise it); terms of `shard`."""
    syncs = [p for p in peers if manifest.may_synchronize(p["peer_id"])]
    reported = sorted((term_of(p, shard) for p in syncs), reverse=True)
    floor = reported[1] if len(reported) >= 2 else 0
    return lease_rules.screen_leases(
        [lease_rules.SeenLease(lease, now) for lease in leases],
        term_floor=floor,
        timing=manifest.timing,
        may_synchronize=manifest.may_synchronize,
        # only peers that may synchronize vouch for a term (a stranger's heartbeat is a self-report)
        terms_reported={p["peer_id"]: term_of(p, shard) for p in syncs},
    )


_UNIX_TIME = re.compile(r"(?<![\w.])(1\d{9}(?:\.\d+)?)(?![\w.])")  # a unix time of 2001-2033 in a line


def human_time(t: float, now: float) -> str:
    """A unix time as a volunteer reads it: the UTC clock time and how far from `now` ("in 12 s")."""
    delta = t - now
    size = f"{abs(delta):.0f} s" if abs(delta) < 120 else f"{abs(delta) / 60:.0f} min"
    when = f"in {size}" if delta >= 0 else f"{size} ago"
    return f"{datetime.fromtimestamp(t, UTC).strftime('%H:%M:%S')} UTC ({when})"


def humanize_times(line: str, now: float) -> str:
    """`line` with each raw unix time in it (the peers' decision lines) written by `human_time`."""
    return _UNIX_TIME.sub(lambda m: human_time(float(m.group(1)), now), line)


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def format_status(status: dict[str, Any]) -> str:
    lines = [
        f"run {status['run_id']} (manifest {status['manifest_hash']}): "
        f"{plural(len(status['peers']), 'live peer')}, "
        f"{sum(p['listed'] for p in status['peers'])} that may synchronize "
        "(the others' rows are their claims)"
    ]
    sync = status["synchronizer"]
    if sync:
        lines.append(
            f"synchronizer: {sync['peer_id']} term {sync['term']} "
            f"(lease expires in {sync['expires_in']:.1f} s)"
        )
    else:
        lines.append(f"synchronizer: none (highest term seen {status['highest_term']})")
    shards = status.get("shards", [])  # absent in a status written before shards existed
    for row in shards if len(shards) > 1 else ():
        holder, fragments = row["synchronizer"], ",".join(map(str, row["fragments"]))
        held = (
            f"{holder['peer_id']} term {holder['term']}" if holder else f"none (term {row['highest_term']})"
        )
        lines.append(f"shard {row['shard']} (fragments {fragments}): {held}")
    if status["peers"]:
        lines.append("fragments: " + "  ".join(f"{f['index']}:v{f['version']}" for f in status["fragments"]))
    else:
        lines.append("fragments: unknown (no live peer reports its versions)")
    ev = status.get("eval")
    if ev is not None:
        lines.append(
            f"global eval: loss {ev['loss']:.4f} (perplexity {ev['perplexity']:.2f}) at versions "
            f"{','.join(str(v) for v in ev['versions'])}, {ev['tokens']:,} merged tokens, "
            f"{status['time'] - ev['t']:.0f} s ago, by {ev['evaluator']}"
        )
    else:
        lines.append("global eval: none published yet")
    lines += _peer_lines(status)
    for refused in status.get("refused_leases", []):
        lines.append(f"refused lease: {refused['peer_id']} term {refused['term']}: {refused['reason']}")
    if status["ignored"]:
        lines.append(f"ignored records: {status['ignored']}")
    if status.get("ledger") is not None:
        lines.append(format_ledger(status["ledger"]))
    return "\n".join(lines)


def _peer_lines(status: dict[str, Any]) -> list[str]:
    """The live peers' table, then each peer's rejections and its last decisions."""
    lines: list[str] = []
    if status["peers"]:
        lines.append(
            f"{'peer':<48} {'role':<12} {'step':>7} {'loss':>6} {'tok/s':>8} {'applied':>7} "
            f"{'contrib':>8} {'digest':<16} versions"
        )
    for p in status["peers"]:
        age = p["last_contribution_age"]
        lines.append(
            f"{p['peer_id']:<48} {p['role'] + ('' if p['listed'] else '*'):<12} {p['step']:>7} "
            f"{p['loss']:>6.3f} {p['tokens_per_s']:>8.0f} "
            f"{p['updates_applied']:>7} {(f'{age:.1f}s ago' if age is not None else 'never'):>8} "
            f"{p['digest']:<16} {','.join(str(v) for v in p['versions'])}"
        )
    for p in status["peers"]:
        if p["rejections"]:
            counts = ", ".join(f"{tag}: {n}" for tag, n in p["rejections"].items())
            lines.append(f"rejections at {p['peer_id'][:16]}: {counts}")
        for sender, tag, n in p["rejections_by_sender"]:
            lines.append(f"  from {sender[:16]}: {tag}: {n}")
    for p in status["peers"]:
        for line in p["decisions"][-3:]:
            lines.append(f"{p['peer_id'][:16]}: {humanize_times(line, status['time'])}")
    return lines


def local_ledger(args: argparse.Namespace) -> dict[str, Any] | None:
    """The ledger report of ``--state-dir`` (None without one); `ConfigError` if the folder is missing."""
    state_dir = getattr(args, "state_dir", None)
    if state_dir is None:
        if getattr(args, "ledger", False):
            raise ConfigError("--ledger reads a peer's ledger: pass that peer's --state-dir")
        return None
    if not Path(state_dir).is_dir():
        raise ConfigError(f"--state-dir {state_dir} does not exist or is not a directory")
    return ledger_report(read_ledger(state_dir), last=getattr(args, "last", 0))


def cli_status(args: argparse.Namespace) -> int:
    """`p2p-diloco status MANIFEST --initial-peers ADDR... [--json] [--wait S]`."""
    manifest = load_run_manifest(args.manifest)
    ledger = local_ledger(args)
    if getattr(args, "ledger", False):
        print(json.dumps(ledger) if args.json else format_ledger(ledger), flush=True)
        return 0
    initial = list(args.initial_peers or manifest.bootstrap)
    if not initial:
        raise ConfigError(
            f"no peer to ask: {args.manifest} names no bootstrap node; pass --initial-peers ADDR (the whole "
            "`bootstrap address:` line the run's bootstrap node printed, /ip4/HOST/tcp/PORT/p2p/Qm...)"
        )
    try:
        status = read_status(manifest, initial, args)
    except (ConnectionError, TimeoutError) as exc:
        print(f"p2p-diloco status: {exc}", file=sys.stderr)
        return 1
    if ledger is not None:
        status["ledger"] = ledger
    print(json.dumps(status) if args.json else format_status(status), flush=True)
    if not status["peers"]:
        print(
            f"p2p-diloco status: no live peer of run {manifest.run_id} "
            f"seen through {plural(len(initial), 'initial peer')} "
            f"within --wait {args.wait:g} s: nobody trains this run now, or the address is another run's "
            "(check the manifest and --initial-peers; a peer that just joined shows within a heartbeat, "
            "try --wait 30)",
            file=sys.stderr,
        )
        return 1
    return 0


def read_status(manifest: RunManifest, initial: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """`swarm_status` read through a passive DHT client, retried while no peer is seen until --wait."""
    dht_peer = create_dht(initial_peers=initial, client_mode=True)
    try:
        kv = DhtKeyValueStore(dht_peer, timeout=args.timeout)
        deadline = time.monotonic() + args.wait
        while True:  # right after joining the DHT a lookup can come back empty: retry until --wait
            status = swarm_status(kv, manifest, get_dht_time())
            if status["peers"] or time.monotonic() >= deadline:
                return status
            time.sleep(0.5)
    finally:
        dht_peer.shutdown()
