#!/usr/bin/env python
"""Byzantine benchmark: eval loss with one hostile learner of four, against the all-honest swarm.

    .venv/bin/python scripts/bench_byzantine.py --out bench-out [--tokens N] [--kinds a,b] [--seeds 0,1]
                                                [--undefended a,b]

The in-process swarm of `scripts/bench_quality.py` (4 learners, 1 / 1 / 1.5 / 2 fake s per step, K = 1
with the grace window, the demo manifest with the default [robust] checks; docs/results/byzantine-* were
made when the demo manifest had H = 8, it now has H = 32) runs once all honest, then once per attack of
`p2p_diloco.swarm.hostile` with learner 0 (one of the two fastest) hostile, all at the same total
token budget (the hostile learner's tokens count: its compute is lost). The attacks include issue #12's
`revert` (honest-looking deltas back toward the initial weights claiming 10^6 steps with matching
tokens) and `inflated_claim` (the claim alone); for each run `hostile_weight_vs_h` is the largest merge
weight the hostile learner got, over the weight of an honest learner's H steps (above 1: the claim
bought extra weight). Also run:
  honest3       the three honest learners alone for the same fake time: what a perfect defence reaches,
                since the hostile learner's compute is lost whatever the defence does (with learner 0,
                one of the two fastest, that is 32 % of the tokens: the floor of the ratio below);
  honest-robust-off  all honest with every robust check off: what the defaults cost honest runs
                (target: the defended honest run within 1 % of it);
  <kind>-undefended  an attack with the robust checks disabled (`--undefended`, none by default).
The robust checks run at a public run's defaults (the loss check on) unless `--private`.
Every run is repeated per seed (data order and initial weights); a run's ratio is its loss over the
all-honest loss of the same seed, averaged over seeds (runs differ by about 2 % between seeds).
Writes DIR/byzantine.json (per run and seed: final eval loss, ratio to all-honest, versions, the hostile
learner's merged and trained steps, rejections and cool-downs by sender) and DIR/byzantine.png.
Target reported, not asserted: every attack within 5 % of the all-honest eval loss. Also reported:
`vs_honest3`, each run's loss over the honest3 loss (1.0 = the defence costs nothing beyond the
attacker's own compute). `--hostile-learner 3` makes the slowest learner (16 % of the tokens) hostile.
The default (1M tokens, 8 runs) takes about 6-8 minutes on 2 free cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections import Counter
from pathlib import Path

import torch

from p2p_diloco.config import ModelConfig, RunManifest
from p2p_diloco.model.data import load_corpus
from p2p_diloco.protocol.robust import RobustConfig
from p2p_diloco.swarm.hostile import ATTACKS, GENERIC, FreshKeyAdversary
from p2p_diloco.swarm.inprocess import InProcessSwarm, SwarmSpec

SPEEDS = (1.0, 1.0, 1.5, 2.0)
TARGET = 0.05


def run(
    manifest: RunManifest, corpus, *, tokens: int, speeds: tuple[float, ...], hostile: dict, seed: int
) -> dict:
    per_step = manifest.diloco.batch_size * manifest.model.block_size
    fake = tokens / per_step / sum(1 / s for s in speeds)
    spec = SwarmSpec(
        manifest=manifest,
        learners=len(speeds),
        step_times=speeds,
        total_tokens=tokens,
        eval_every=max(1.0, fake / 10),
        hostile=hostile,
        seed=seed,
    )
    swarm = InProcessSwarm(spec, corpus=corpus)
    report = swarm.run()
    rejected: Counter[tuple[str, str]] = Counter()
    cooldowns = []
    for peer in swarm.peers.values():
        rejected.update(peer.robust.rejected)
        cooldowns += [(round(t, 1), sender, tag) for t, sender, tag in peer.robust.cooldowns]
    result = {
        "final_eval_loss": report.final_eval_loss,
        "tokens": report.tokens,
        "fake_seconds": report.fake_seconds,
        "versions": list(report.versions),
        "digests_equal": report.digests_equal,
        "rejections": {f"{s} {tag}": n for (s, tag), n in sorted(rejected.items())},
        "cooldowns": sorted(cooldowns),
        "curve": [(tok, loss) for _, tok, loss in report.eval_curve],
    }
    for i in hostile:
        stats = report.learners[i]
        result["hostile_merged_steps"] = stats.steps_merged
        result["hostile_steps"] = stats.steps
        peer = next(iter(swarm.peers.values()))  # every replica applied every update
        logged = [r for p in range(len(peer.replica.versions())) for r in peer.book.log.after(p, 0)]
        weights = [w for r in logged for s, w in r.contributors if s == stats.peer_id]
        honest_h = manifest.diloco.inner_steps * per_step * per_step  # tokens^2 / steps for H steps
        result["hostile_weight_vs_h"] = max(weights, default=0.0) / honest_h
    return result


def fresh_key_shares(swarm: InProcessSwarm) -> dict:
    """Over every update one replica applied: the fresh keys' (the generic learner's, `fresh-*`) share of all
    merge weight, the largest weight one fresh key got over its round's median weight of the others, and
    over its round's total."""
    peer = next(iter(swarm.peers.values()))
    logged = [r for p in range(len(peer.replica.versions())) for r in peer.book.log.after(p, 0)]
    total = fresh = 0.0
    worst_vs_median = worst_share = 0.0
    for record in logged:
        weights = [w for _, w in record.contributors]
        total += sum(weights)
        for sender, w in record.contributors:
            if not sender.startswith("fresh-"):
                continue
            fresh += w
            others = sorted(x for s, x in record.contributors if not s.startswith("fresh-"))
            if others:
                worst_vs_median = max(worst_vs_median, w / others[(len(others) - 1) // 2])
            worst_share = max(worst_share, w / sum(weights))
    return {
        "fresh_weight_share": fresh / total if total else 0.0,
        "fresh_max_vs_round_median": worst_vs_median,
        "fresh_max_round_share": worst_share,
        "updates": len(logged),
    }


def sweep_run(manifest: RunManifest, corpus, *, speeds, hostile: dict, seed: int, duration: float) -> dict:
    spec = SwarmSpec(
        manifest=manifest,
        learners=len(speeds),
        step_times=tuple(speeds),
        duration=duration,
        eval_every=max(1.0, duration / 10),
        hostile=hostile,
        seed=seed,
    )
    swarm = InProcessSwarm(spec, corpus=corpus)
    return run_figures(swarm, swarm.run())


def run_figures(swarm: InProcessSwarm, report) -> dict:  # noqa: ANN001 - the swarm's run report
    """A fresh-key run's figures: loss, tokens, versions, replicas equal, refusals by tag, fresh keys' weight."""
    rejected: Counter[str] = Counter()
    for peer in swarm.peers.values():
        rejected.update(tag for _, tag in peer.robust.rejected.elements())
    return {
        "final_eval_loss": report.final_eval_loss,
        "tokens": report.tokens,
        "versions": list(report.versions),
        "digests_equal": report.digests_equal,
        "rejections_by_tag": dict(sorted(rejected.items())),
        **fresh_key_shares(swarm),
    }


def sweep(args, base: RunManifest, corpus) -> dict:
    """`--fresh-keys N`: N learners, the first k of them generic hostile learners (a fresh key per delta,
    `swarm.hostile.GENERIC`) for k = 10-50 % of N; each run against the clean run (all N honest) and against
    the same honest learners alone for the same fake time (what a perfect defence reaches)."""
    n = args.fresh_keys
    speeds = [SPEEDS[i % len(SPEEDS)] for i in range(n)]
    per_step = base.diloco.batch_size * base.model.block_size
    duration = args.tokens / per_step / sum(1 / s for s in speeds)
    counts = sorted({max(1, round(n * f / 10)) for f in range(1, 6)})
    results: dict[str, dict] = {}
    for seed in [int(x) for x in args.seeds.split(",")]:
        clean = sweep_run(base, corpus, speeds=speeds, hostile={}, seed=seed, duration=duration)
        results.setdefault("clean", {})[seed] = clean
        print(f"seed {seed} clean {n} honest: loss {clean['final_eval_loss']:.4f}", flush=True)
        for k in counts:
            alone = sweep_run(base, corpus, speeds=speeds[k:], hostile={}, seed=seed, duration=duration)
            attacked = sweep_run(
                base,
                corpus,
                speeds=speeds,
                hostile=dict.fromkeys(range(k), GENERIC),
                seed=seed,
                duration=duration,
            )
            attacked["vs_clean"] = attacked["final_eval_loss"] / clean["final_eval_loss"]
            attacked["vs_honest_alone"] = attacked["final_eval_loss"] / alone["final_eval_loss"]
            results.setdefault(f"{k}/{n} hostile", {})[seed] = attacked
            results.setdefault(f"{n - k} honest alone", {})[seed] = alone
            print(
                f"seed {seed} {k}/{n} hostile: loss {attacked['final_eval_loss']:.4f} "
                f"vs clean x{attacked['vs_clean']:.4f} vs honest alone x{attacked['vs_honest_alone']:.4f} "
                f"fresh share {attacked['fresh_weight_share']:.3f} "
                f"max/median {attacked['fresh_max_vs_round_median']:.2f}",
                flush=True,
            )
    return {"learners": n, "speeds": speeds, "tokens": args.tokens, "fake_seconds": duration, "runs": results}


def share_run(manifest: RunManifest, corpus, *, share: float, seed: int, seconds: float) -> dict:
    """The 4-learner swarm (SPEEDS) for `seconds` fake seconds, with `share` of all deltas from generic hostile
    learners with a fresh key per delta (`FreshKeyAdversary`; 0: the clean run)."""
    spec = SwarmSpec(
        manifest=manifest,
        learners=len(SPEEDS),
        step_times=SPEEDS,
        duration=seconds,
        eval_every=seconds,
        seed=seed,
    )
    swarm = InProcessSwarm(spec, corpus=corpus)
    adversary = FreshKeyAdversary(swarm, share=share, seed=seed) if share > 0 else None
    if adversary is not None:
        adversary.install()
    figures = run_figures(swarm, swarm.run())
    return figures | {"hostile_deltas": 0 if adversary is None else adversary.sent}


def share_sweep(args, base: RunManifest, corpus) -> dict:
    """`--fresh-share`: 4 honest learners, and generic hostile learners with a fresh key per delta sending
    10-50 % of all deltas, each run against the same seeded run without them."""
    runs: dict[str, dict] = {}
    for seed in [int(x) for x in args.seeds.split(",")]:
        clean = share_run(base, corpus, share=0.0, seed=seed, seconds=args.seconds)
        runs.setdefault("clean", {})[seed] = clean
        print(f"seed {seed} clean: loss {clean['final_eval_loss']:.4f}", flush=True)
        for share in (0.1, 0.2, 0.3, 0.4, 0.5):
            r = share_run(base, corpus, share=share, seed=seed, seconds=args.seconds)
            r["vs_clean"] = r["final_eval_loss"] / clean["final_eval_loss"]
            runs.setdefault(f"{share:.0%} hostile", {})[seed] = r
            print(
                f"seed {seed} {share:.0%} hostile ({r['hostile_deltas']} deltas): loss {r['final_eval_loss']:.4f} "
                f"x{r['vs_clean']:.4f}, fresh weight share {r['fresh_weight_share']:.3f}, "
                f"max/median {r['fresh_max_vs_round_median']:.2f}",
                flush=True,
            )
    means = {
        name: sum(r["vs_clean"] for r in by_seed.values()) / len(by_seed)
        for name, by_seed in runs.items()
        if name != "clean"
    }
    return {
        "learners": len(SPEEDS),
        "speeds": SPEEDS,
        "seconds": args.seconds,
        "vs_clean": means,
        "runs": runs,
    }


def sim_scale(manifest: RunManifest) -> RunManifest:
    """The sim tier's scale (tests/sim/conftest.py): a smaller model, H = 8, batch 8."""
    return dataclasses.replace(
        manifest,
        model=ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=32),
        diloco=dataclasses.replace(manifest.diloco, inner_steps=8, batch_size=8),
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=1_000_000, help="total tokens per run (all learners)")
    parser.add_argument("--kinds", default=",".join(ATTACKS))
    parser.add_argument("--undefended", default="", help="attacks to rerun with the robust checks off")
    parser.add_argument("--manifest", default="peers/demo.toml")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds; ratios are averaged over them")
    parser.add_argument("--hostile-learner", type=int, default=0, choices=range(len(SPEEDS)))
    parser.add_argument(
        "--private",
        action="store_true",
        help="the private-run defaults (no loss check) instead of a public run's (loss check on)",
    )
    parser.add_argument(
        "--fresh-keys",
        type=int,
        default=0,
        metavar="N",
        help="instead: N learners, 10-50 %% of them generic hostile learners with a fresh key per delta",
    )
    parser.add_argument(
        "--fresh-share",
        action="store_true",
        help="instead: 4 honest learners and fresh-key hostile deltas at 10-50 %% of all deltas (--seconds)",
    )
    parser.add_argument("--seconds", type=float, default=120.0, help="fake seconds per --fresh-share run")
    parser.add_argument("--sim-scale", action="store_true", help="the sim tier's model, H = 8, batch 8")
    parser.add_argument(
        "--codec", default="", help="e.g. topk-int8: a sparse codec makes rounds union rounds"
    )
    parser.add_argument("--density", type=float, default=0.03, help="with a sparse --codec")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # the robust checks at a public run's defaults (the demo manifest turns its direction screen off; a
    # public run, [trust] authority set, turns the loss check on): in-process peers have no peer IDs to
    # list, so the loss check is set directly
    robust = RobustConfig() if args.private else RobustConfig(loss_check="on")
    base = dataclasses.replace(RunManifest.load(args.manifest), robust=robust)
    if args.sim_scale:
        base = sim_scale(base)
    if args.codec:
        base = dataclasses.replace(
            base, wire=dataclasses.replace(base.wire, codec=args.codec, density=args.density)
        )
    if args.fresh_share:
        summary = share_sweep(args, base, load_corpus(base.data))
        summary["public_defaults"] = not args.private
        summary["sim_scale"] = args.sim_scale
        summary["codec"] = base.wire.codec
        (out / "fresh_share.json").write_text(json.dumps(summary, indent=2))
        plot_share(summary, out / "fresh_share.png")
        print(json.dumps(summary["vs_clean"]))
        return 0
    if args.fresh_keys:
        summary = sweep(args, base, load_corpus(base.data))
        summary["public_defaults"] = not args.private
        (out / "fresh_keys.json").write_text(json.dumps(summary, indent=2))
        plot_sweep(summary, out / "fresh_keys.png")
        return 0
    defended = base
    undefended = dataclasses.replace(base, robust=dataclasses.replace(base.robust, enabled=False))
    corpus = load_corpus(base.data)
    bad = args.hostile_learner
    honest3_speeds = SPEEDS[:bad] + SPEEDS[bad + 1 :]
    honest3_tokens = round(args.tokens * sum(1 / s for s in honest3_speeds) / sum(1 / s for s in SPEEDS))
    plan: list[tuple[str, RunManifest, dict, tuple[float, ...], int]] = [
        ("honest", defended, {}, SPEEDS, args.tokens),
        ("honest3", defended, {}, honest3_speeds, honest3_tokens),
        ("honest-robust-off", undefended, {}, SPEEDS, args.tokens),
    ]
    for kind in filter(None, args.kinds.split(",")):
        plan.append((kind, defended, {bad: kind}, SPEEDS, args.tokens))
    for kind in filter(None, args.undefended.split(",")):
        plan.append((f"{kind}-undefended", undefended, {bad: kind}, SPEEDS, args.tokens))
    for name, _, hostile, _, _ in plan:
        if any(kind not in ATTACKS for kind in hostile.values()):
            parser.error(f"unknown attack in {name!r}; attacks are {ATTACKS}")
    seeds = [int(x) for x in args.seeds.split(",")]
    results: dict[str, dict] = {name: {"seeds": {}} for name, *_ in plan}
    for seed in seeds:
        for name, manifest, hostile, speeds, tokens in plan:
            start = time.perf_counter()
            r = run(manifest, corpus, tokens=tokens, speeds=speeds, hostile=hostile, seed=seed)
            r["seconds"] = time.perf_counter() - start
            results[name]["seeds"][seed] = r
            r["ratio_vs_honest"] = r["final_eval_loss"] / results["honest"]["seeds"][seed]["final_eval_loss"]
            weight = f"  weight/H {r['hostile_weight_vs_h']:.2f}" if "hostile_weight_vs_h" in r else ""
            print(
                f"seed {seed} {name:24s} loss {r['final_eval_loss']:.4f}  x{r['ratio_vs_honest']:.3f}{weight}  "
                f"({r['seconds']:.0f} s)",
                flush=True,
            )
    for entry in results.values():
        runs = entry["seeds"].values()
        entry["final_eval_loss"] = sum(r["final_eval_loss"] for r in runs) / len(seeds)
        entry["ratio_vs_honest"] = sum(r["ratio_vs_honest"] for r in runs) / len(seeds)
        entry["curve"] = entry["seeds"][seeds[0]]["curve"]
    for entry in results.values():
        entry["vs_honest3"] = sum(
            r["final_eval_loss"] / results["honest3"]["seeds"][seed]["final_eval_loss"]
            for seed, r in entry["seeds"].items()
        ) / len(seeds)
    attacks = {k: v["ratio_vs_honest"] for k, v in results.items() if k in ATTACKS}
    summary = {
        "learners": len(SPEEDS),
        "speeds": SPEEDS,
        "hostile_learner": bad,
        "hostile_token_share": (1 / SPEEDS[bad]) / sum(1 / s for s in SPEEDS),
        "tokens": args.tokens,
        "seeds": seeds,
        "target": TARGET,
        "ratio_vs_honest": {k: v["ratio_vs_honest"] for k, v in results.items()},
        "vs_honest3": {k: v["vs_honest3"] for k, v in results.items()},
        "worst_attack": max(attacks, key=attacks.get) if attacks else None,
        "all_within_target": all(r <= 1 + TARGET for r in attacks.values()),
        "honest_vs_robust_off": results["honest"]["final_eval_loss"]
        / results["honest-robust-off"]["final_eval_loss"],
        "public_defaults": not args.private,
        "runs": results,
    }
    (out / "byzantine.json").write_text(json.dumps(summary, indent=2))
    plot(results, out / "byzantine.png")
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}))
    return 0


def plot_share(summary: dict, path: Path, label: str = "") -> None:
    """Final eval loss over the clean run's, per hostile share of the deltas, one line per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in summary["runs"] if n != "clean"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for seed in summary["runs"]["clean"]:
        ax.plot(
            names, [summary["runs"][n][seed]["vs_clean"] for n in names], marker="o", label=f"seed {seed}"
        )
    ax.axhline(1.01, color="black", linestyle="--", label="+1 %")
    ax.set_ylabel("final eval loss / clean run")
    ax.set_title(f"fresh-key hostile learners, {summary.get('codec', '')} {label}".strip())
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_sweep(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {k: v for k, v in summary["runs"].items() if "hostile" in k}
    names = list(runs)
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("vs_honest_alone", "vs the honest learners alone"), ("vs_clean", "vs all honest")):
        means = [sum(r[key] for r in runs[n].values()) / len(runs[n]) for n in names]
        ax.plot(names, means, marker="o", label=label)
    ax.axhline(1.01, color="black", linestyle="--", label="+1 %")
    ax.set_ylabel("final eval loss ratio (mean over seeds)")
    ax.set_title(f"generic hostile learners, a fresh key per delta ({summary['learners']} learners)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, curves) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(results)
    ratios = [results[n]["ratio_vs_honest"] for n in names]
    colors = [
        "tab:green" if n.startswith("honest") else "tab:red" if "undefended" in n else "tab:blue"
        for n in names
    ]
    bars.bar(range(len(names)), ratios, color=colors)
    bars.axhline(1 + TARGET, color="black", linestyle="--", label=f"target: +{TARGET:.0%}")
    bars.set_xticks(range(len(names)), names, rotation=35, ha="right")
    bars.set_ylabel("final eval loss / all-honest")
    top = min(1.5, max(1.1, max(ratios) + 0.03))  # a diverged run would flatten every other bar
    bars.set_ylim(min(0.95, min(ratios) - 0.02), top)
    for x, ratio in enumerate(ratios):
        bars.text(x, min(ratio, top - 0.02), f"{ratio:.3f}", ha="center", va="bottom", fontsize=7)
    bars.set_title("one hostile learner of four, equal tokens")
    bars.legend()
    for name in names:
        xs, ys = zip(*results[name]["curve"])
        curves.plot(xs, ys, label=f"{name} (mean final {results[name]['final_eval_loss']:.3f})")
    curves.set_title("eval loss, first seed")
    curves.set_xlabel("training tokens (all learners)")
    curves.set_ylabel("eval loss (nats/byte)")
    curves.set_ylim(top=min(4.0, max(y for r in results.values() for _, y in r["curve"])))
    curves.legend(fontsize=7)
    curves.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
