"""The in-process half of scripts/bench_swarm.py (`--inprocess 64,256,1024`): see its docstring there.

Per size M: the dissemination model (`p2p_diloco.sim.dissemination`) under today's rule (the holder
pushes to every peer, S = 1) and the relay tree (`--fanout`) with each S of `--shards`, with the demo
model's int8 fragment frames as deltas and updates and every peer on one `LinkSpec` (`--up-mbit`,
`--down-mbit`, `--latency-ms`). For the sizes up to `--real-upto` also the in-process swarm of real `Peer`
objects (`swarm.inprocess`, tiny GPT, the same link model on its `SimNetwork`) for `--real-seconds` fake
seconds: its busiest peer's bytes per round beside the model's, and its wall seconds per fake second
(why 1024 real peers are out of reach). Writes OUT/inprocess.json and OUT/inprocess.png.

`--peers-per-shard N` adds one more rule: the relay tree with S grown with the swarm, S = M / N shards over
as many fragments (P = max(manifest P, S)), every fragment's frames the model's int8 bytes / P, so a round
still moves the whole model once per learner. A shard holder then receives (M - 1) / S fragment deltas, the
same at every size: what a run's organizer gets by listing about M / N synchronizers and setting
`synchronizer_shards` and `fragments` to that at the start.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from p2p_diloco.config import ModelConfig, RunManifest
from p2p_diloco.sim.dissemination import SpreadSpec, fragment_frame_bytes, run_spread
from p2p_diloco.swarm.links import MBIT, LinkModel, LinkSpec

REFERENCE = 64  # issue #29: the 1024-peer run against the 64-peer one


def rule_of(row: dict[str, Any]) -> str:
    """The rule a model row ran under (rows written before `rule` was stored: from fanout and S)."""
    return row.get("rule") or f"fanout={row['fanout'] or 'all'} S={row['shards']}"


def scaled_shards(peers: int, peers_per_shard: int, max_shards: int) -> int:
    """S for `peers` under `--peers-per-shard`: M / N rounded down, at least 1, at most `max_shards`."""
    return max(1, min(max_shards, peers // peers_per_shard))


def real_swarm(peers: int, seconds: float, link: LinkSpec) -> dict[str, Any]:
    """The in-process swarm of real `Peer` objects on the link model: bytes per round, wall cost."""
    from p2p_diloco.model.data import load_corpus
    from p2p_diloco.swarm.inprocess import InProcessSwarm, SwarmSpec

    base = RunManifest.load(Path(__file__).resolve().parents[1] / "peers" / "demo.toml")
    manifest = dataclasses.replace(
        base,
        model=ModelConfig(n_layer=1, n_head=1, n_embd=16, block_size=16),
        diloco=dataclasses.replace(base.diloco, inner_steps=8, batch_size=1),
    )
    torch.set_num_threads(1)
    spec = SwarmSpec(manifest=manifest, learners=peers, duration=seconds, eval_every=1e9, eval_batches=1)
    started = time.time()
    swarm = InProcessSwarm(spec, corpus=load_corpus(manifest.data))
    swarm.network.links = LinkModel(default=link)
    built = time.time()
    report = swarm.run()
    wall = time.time() - built
    rounds = sum(report.versions) / manifest.diloco.fragments  # one update of every fragment
    moved = {
        p: swarm.network.bytes_sent.get(p, 0) + swarm.network.bytes_received.get(p, 0)
        for p in swarm.network.handlers
    }
    busiest = max(moved, key=moved.get)
    return {
        "peers": peers,
        "fake_seconds": report.fake_seconds,
        "rounds": rounds,
        "update_bytes": fragment_frame_bytes(manifest),
        "busiest_bytes_per_round": moved[busiest] / rounds if rounds else None,
        "median_bytes_per_round": statistics.median(moved.values()) / rounds if rounds else None,
        "replicas_agree": report.digests_equal,
        "setup_seconds": built - started,
        "wall_seconds": wall,
        "wall_per_fake_second": wall / report.fake_seconds,
    }


def figures(rows: list[dict[str, Any]], fanout: int) -> dict[str, Any]:
    """Busiest peer's bytes per round at the largest size over `REFERENCE` peers (else the smallest size):
    target <= 2x, per rule; and the depth at each size."""
    out: dict[str, Any] = {}
    for name in sorted({rule_of(r) for r in rows}):
        mine = sorted((r for r in rows if rule_of(r) == name), key=lambda r: r["peers"])
        if len(mine) < 2:
            continue
        lo, hi = next((r for r in mine if r["peers"] == REFERENCE), mine[0]), mine[-1]
        for what in ("busiest_bytes_per_round", "max_update_bytes_per_round"):
            value = hi[what] / lo[what] if lo[what] else None
            out.setdefault(name, {})[f"{what}_{hi['peers']}_over_{lo['peers']}"] = {
                "value": value,
                "target": 2.0,
                "met": value is not None and value <= 2.0,
                "what": f"{what.replace('_', ' ')}, {hi['peers']} peers / {lo['peers']} peers",
            }
        out[name]["depth"] = {r["peers"]: r["depth_max"] for r in mine}
    return out


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["model"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for label in sorted({rule_of(r) for r in rows}):
        mine = sorted((r for r in rows if rule_of(r) == label), key=lambda r: r["peers"])
        n = [r["peers"] for r in mine]
        axes[0].plot(n, [r["busiest_bytes_per_round"] / 1e6 for r in mine], "o-", label=f"{label}: all")
        axes[0].plot(
            n, [r["max_update_bytes_per_round"] / 1e6 for r in mine], "x--", label=f"{label}: updates"
        )
        axes[1].plot(n, [r["depth_max"] for r in mine], "o-", label=label)
        axes[2].plot(n, [r["propagation_max"] for r in mine], "o-", label=label)
    real = report.get("real", [])
    if real:
        axes[0].plot(
            [r["peers"] for r in real],
            [
                (r["busiest_bytes_per_round"] or 0) * report["update_bytes"] / r["update_bytes"] / 1e6
                for r in real
            ],
            "k*",
            markersize=10,
            label="real Peer objects (scaled to the same frame size)",
        )
    axes[0].set_ylabel("busiest peer, MB per round (all fragments once)")
    axes[0].set_yscale("log")
    axes[1].set_ylabel("propagation depth, hops (max)")
    axes[2].set_ylabel("publish -> last peer, fake seconds (max)")
    axes[2].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("peers")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=6)
    link = report["config"]["link"]
    fig.suptitle(
        f"dissemination model, {report['update_bytes'] / 1e3:.0f} kB frames, links {link['up'] / MBIT:.0f}/"
        f"{link['down'] / MBIT:.0f} Mbit/s up/down, {link['latency'] * 1e3:.0f} ms"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_figures(figs: dict[str, Any]) -> None:
    for rule, items in figs.items():
        for name, f in items.items():
            if name == "depth":
                print(f"{rule} depth (hops) by peers: {f}")
                continue
            value = "-" if f["value"] is None else f"{f['value']:.2f}"
            print(f"{rule} {name}: {value} (target <= {f['target']}: {'met' if f['met'] else 'MISSED'})")


def inprocess_main(args: argparse.Namespace) -> int:
    path = args.out / "inprocess.json"
    if args.tabulate:
        report = json.loads(path.read_text())
    else:
        manifest = RunManifest.load(args.manifest)
        size = fragment_frame_bytes(manifest)
        link = LinkSpec(up=args.up_mbit * MBIT, down=args.down_mbit * MBIT, latency=args.latency_ms / 1e3)
        fragments = manifest.diloco.fragments
        rules = [
            (f"fanout={f or 'all'} S={s}", f, lambda m, s=s: s)
            for f, s in [(0, 1)] + [(args.fanout, s) for s in args.shards]
        ]
        if args.peers_per_shard:
            n = args.peers_per_shard
            rules.append((f"fanout={args.fanout} S=M/{n}", args.fanout, lambda m: scaled_shards(m, n, m)))
        rows = []
        for peers in args.inprocess:
            for name, fanout, shards_for in rules:
                shards = shards_for(peers)
                split = max(fragments, shards)  # the same model bytes over more, smaller fragments
                frame = size * fragments // split
                spec = SpreadSpec(
                    peers=peers,
                    update_bytes=frame,
                    delta_bytes=frame,
                    fragments=split,
                    shards=shards,
                    fanout=fanout,
                    rounds=args.rounds,
                    link=link,
                )
                started = time.time()
                row = run_spread(spec) | {"rule": name, "wall_seconds": time.time() - started}
                rows.append(row)
                print(
                    f"model M={peers} {name} (S={shards}, P={split}): busiest "
                    f"{row['busiest_bytes_per_round'] / 1e6:.2f} MB/round (updates "
                    f"{row['max_update_bytes_per_round'] / 1e6:.2f}), depth {row['depth_max']}, "
                    f"publish -> last {row['propagation_max']:.2f} s",
                    flush=True,
                )
        real = []
        for peers in [p for p in args.inprocess if p <= args.real_upto]:
            print(f"real in-process swarm of {peers} peers, {args.real_seconds} fake s ...", flush=True)
            real.append(real_swarm(peers, args.real_seconds, link))
            print(f"  {json.dumps(real[-1])}", flush=True)
        config = {
            "peers": args.inprocess,
            "fanout": args.fanout,
            "shards": args.shards,
            "peers_per_shard": args.peers_per_shard,
            "rounds": args.rounds,
            "link": dataclasses.asdict(link),
            "real_upto": args.real_upto,
            "real_seconds": args.real_seconds,
        }
        report = {"config": config, "update_bytes": size, "model": rows, "real": real}
    report["figures"] = figures(report["model"], report["config"]["fanout"])
    path.write_text(json.dumps(report, indent=1, default=str))
    print_figures(report["figures"])
    plot(report, args.out / "inprocess.png")
    print(f"wrote {path} and {args.out / 'inprocess.png'}")
    return 0
