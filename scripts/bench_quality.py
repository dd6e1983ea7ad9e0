#!/usr/bin/env python
"""Quality benchmark: eval loss at equal total tokens for data-parallel and three DiLoCo variants.

    .venv/bin/python scripts/bench_quality.py --out bench-out [--learners 4] [--tokens N] [--seeds 0,1,2]
    .venv/bin/python scripts/bench_quality.py --out DIR --combine A/quality.json B/quality.json

Variants (all on the embedded corpus, the same tiny GPT, the same total number of training tokens):
  dp              one learner, M x batch, plain AdamW (the data-parallel reference)
  diloco_sync     M learners of equal speed, minimum quorum K = M
  decoupled       M learners of unequal speed (1, 1, 1.5, 2 fake s/step ...), K = 1 with the grace window
  decoupled_fp32  as decoupled, with fp32 instead of int8 deltas and updates
  decoupled_topk{1,3,10}        as decoupled, sparse "topk-int8" deltas and updates at 1, 3, 10 % density
  decoupled_topk{3,5}_int4      as decoupled, sparse "topk-int4" at 3 and 5 % density
  decoupled_topk3_rotate10      as decoupled_topk3 with a new synchronizer term every 10 rounds: each
                                new term starts without the outer residual (what a failover loses)
  decoupled_h4, decoupled_topk{1,3}_int4_h4, decoupled_topk3_int4_h8
                                int8 / sparse int4 with H = 4 or 8 instead of the manifest's H: more,
                                smaller rounds (the same bytes per round, more bytes per inner step)
  decoupled_4k2_{2,3}_h4, decoupled_4k4_3_h4
                                SparseLoCo's chunked codecs "topk4k-int2" at 2 and 3 %, "topk4k-int4" at
                                3 %, H = 4, feedback decay 0.95 (docs/results.md measured them when the
                                synchronizer still re-sparsified; sparse rounds now merge by union)
  union_<codec>_<percent>[_h<H>][_lr<x10>][_m<x100>][_d<x100>]
                                a chunked codec (sparse rounds merge by union, issue #30), e.g.
                                union_4k2_0p8_h4: topk4k-int2 at 0.8 %, H = 4 (`union_variant`)
Writes DIR/quality.json (final_eval_loss, tokens, bytes_sent, and per swarm variant `wire`: bytes per
parameter per fragment round up (one learner's delta) and down (one pushed update), measured on every
frame the sim network carried, and up bytes per parameter per inner step of a learner; with several seeds
the mean, spread and std, and the mean curve) and DIR/quality.png (loss against tokens, and relative to
`decoupled` when it ran).
Targets reported, not asserted: decoupled within 2 % of dp; int8 within 1 % of fp32; a sparse variant at
<= 0.1 bytes/param/round up and down within 1 % of int8.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import time
from pathlib import Path

import torch

from p2p_diloco.config import RunManifest
from p2p_diloco.model.data import BatchSampler, evaluate, load_corpus
from p2p_diloco.model.gpt import build_model, make_inner_optimizer
from p2p_diloco.swarm.inprocess import InProcessSwarm, SwarmSpec
from p2p_diloco.wire.frames import decode_delta, decode_update

SPEEDS = (1.0, 1.0, 1.5, 2.0, 1.0, 1.25, 1.5, 2.0)


def run_dp(manifest: RunManifest, corpus, learners: int, tokens: int, eval_points: int) -> dict:
    cfg = manifest.diloco
    model = build_model(manifest.model)
    opt = make_inner_optimizer(model, cfg.inner_lr, cfg.inner_weight_decay)
    batch = cfg.batch_size * learners
    sampler = BatchSampler(
        corpus.train, block_size=manifest.model.block_size, batch_size=batch, shard=0, num_shards=1, seed=0
    )
    per_step = batch * manifest.model.block_size
    steps = max(1, tokens // per_step)
    every = max(1, steps // eval_points)
    curve = []
    for step in range(1, steps + 1):
        x, y = sampler.next_batch()
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % every == 0 or step == steps:
            curve.append(
                (step * per_step, evaluate(model, corpus.eval, block_size=manifest.model.block_size))
            )
    return {"final_eval_loss": curve[-1][1], "tokens": steps * per_step, "bytes_sent": 0, "curve": curve}


def run_swarm(
    manifest: RunManifest,
    corpus,
    learners: int,
    tokens: int,
    speeds: tuple[float, ...],
    seed: int = 0,
) -> dict:
    per_step = manifest.diloco.batch_size * manifest.model.block_size
    mean_speed = sum(speeds) / len(speeds)
    fake_duration = tokens / per_step / learners * mean_speed
    spec = SwarmSpec(
        manifest=manifest,
        learners=learners,
        step_times=speeds,
        total_tokens=tokens,
        eval_every=max(1.0, fake_duration / 12),
        seed=seed,
    )
    swarm = InProcessSwarm(spec, corpus=corpus)
    wire = count_wire(swarm)
    report = swarm.run()
    steps = report.tokens / per_step
    params = sum(wire.fragment_params)
    return {
        "wire": {**wire.summary(), "up_bytes_per_param_step": wire.totals["delta"][1] / (params * steps)},
        "final_eval_loss": report.final_eval_loss,
        "tokens": report.tokens,
        "bytes_sent": report.bytes_sent,
        "versions": list(report.versions),
        "goodput": report.goodput,
        "digests_equal": report.digests_equal,
        "curve": [(tok, loss) for _, tok, loss in report.eval_curve],
    }


class WireCount:
    """Bytes and parameters of every delta and pushed update frame (frame headers included; a sparse
    update carries the bundle of the learners' delta frames it lists, as every replica merges them)."""

    def __init__(self, fragment_params: list[int]):
        self.fragment_params = fragment_params
        self.totals = {kind: [0, 0, 0] for kind in ("delta", "update")}  # frames, bytes, params

    def note(self, kind: str, frame: bytes) -> None:
        if kind == "delta":
            p = decode_delta(frame, max_bytes=len(frame))[0].fragment
        else:
            p = decode_update(frame, max_bytes=len(frame)).fragment
        total = self.totals[kind]
        total[0], total[1], total[2] = total[0] + 1, total[1] + len(frame), total[2] + self.fragment_params[p]

    def summary(self) -> dict:
        out = {}
        for kind, (frames, nbytes, params) in self.totals.items():
            name = "up" if kind == "delta" else "down"
            out[f"{name}_frames"] = frames
            out[f"{name}_bytes_per_param_round"] = nbytes / params if params else 0.0
        return out


def count_wire(swarm: InProcessSwarm) -> WireCount:
    shapes = {n: p.shape for n, p in build_model(swarm.manifest.model).named_parameters()}
    plan = swarm.plan
    sizes = [sum(shapes[n].numel() for n in plan.names(p)) for p in range(plan.num_fragments)]
    count = WireCount(sizes)
    deliver = swarm.network.deliver

    def counted(src, dst, frame, kind, on_reply):
        count.note(kind, frame)
        deliver(src, dst, frame, kind, on_reply)

    swarm.network.deliver = counted  # type: ignore[method-assign]
    return count


def sparse(
    base: RunManifest,
    codec: str,
    density: float,
    term_rounds: int | None = None,
    inner_steps: int | None = None,
    feedback_decay: float = 1.0,
) -> RunManifest:
    wire = dataclasses.replace(base.wire, codec=codec, density=density, feedback_decay=feedback_decay)
    timing = base.timing if term_rounds is None else dataclasses.replace(base.timing, term_rounds=term_rounds)
    diloco = base.diloco if inner_steps is None else dataclasses.replace(base.diloco, inner_steps=inner_steps)
    return dataclasses.replace(base, wire=wire, timing=timing, diloco=diloco)


UNION_CODECS = {"4k2": "topk4k-int2", "4k4": "topk4k-int4", "4k8": "topk4k-int8"}
UNION_NAME = re.compile(r"union_(4k[248])_(\d+(?:p\d+)?)((?:_(?:h|lr|m|d)\d+)*)")


def union_variant(base: RunManifest, name: str) -> RunManifest:
    """`union_<codec>_<percent>[_h<H>][_lr<outer lr x 10>][_m<outer momentum x 100>][_d<decay x 100>]`:
    a chunked sparse codec (4k2, 4k4, 4k8: `topk4k-int2/-int4/-int8`) at that density ("1p5" is 1.5 %),
    merged by union (as every sparse codec now is); H, outer lr and momentum default to the manifest's, the
    feedback decay to 0.95. E.g. union_4k2_2_h4_m90: int2 at 2 %, H = 4, outer momentum 0.9."""
    match = UNION_NAME.fullmatch(name)
    if match is None:
        raise ValueError(
            f"{name!r} is not union_<4k2|4k4|4k8>_<percent>[_h<H>][_lr<x10>][_m<x100>][_d<x100>]"
        )
    codec, percent, rest = match.groups()
    opts = {key: int(value) for key, value in re.findall(r"_(h|lr|m|d)(\d+)", rest)}
    manifest = sparse(
        base,
        UNION_CODECS[codec],
        float(percent.replace("p", ".")) / 100,
        inner_steps=opts.get("h"),
        feedback_decay=opts.get("d", 95) / 100,
    )
    diloco = dataclasses.replace(
        manifest.diloco,
        outer_lr=opts["lr"] / 10 if "lr" in opts else manifest.diloco.outer_lr,
        outer_momentum=opts["m"] / 100 if "m" in opts else manifest.diloco.outer_momentum,
    )
    return dataclasses.replace(manifest, diloco=diloco)


def over_seeds(runs: list[dict]) -> dict:
    """One variant over several seeds: mean final loss, spread (max - min) and standard deviation, each
    seed's run, and the mean curve (every seed evaluates at the same token counts: the clock is fake)."""
    losses = [r["final_eval_loss"] for r in runs]
    mean = sum(losses) / len(losses)
    curves = [r["curve"] for r in runs]
    points = min(len(c) for c in curves)
    curve = [
        (sum(c[i][0] for c in curves) / len(curves), sum(c[i][1] for c in curves) / len(curves))
        for i in range(points)
    ]
    out = {
        "final_eval_loss": mean,
        "final_eval_losses": losses,
        "spread": max(losses) - min(losses),
        "std": (sum((x - mean) ** 2 for x in losses) / (len(losses) - 1)) ** 0.5,
        "curve": curve,
        "seeds": runs,
    }
    if "wire" in runs[0]:
        out["wire"] = {k: sum(r["wire"][k] for r in runs) / len(runs) for k in runs[0]["wire"]}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=None, help="total tokens per variant")
    parser.add_argument("--manifest", default="peers/demo.toml")
    parser.add_argument("--seeds", default="0", help="comma-separated swarm seeds; several: mean and spread")
    parser.add_argument(
        "--variants",
        default="dp,diloco_sync,decoupled,decoupled_fp32,decoupled_topk1,decoupled_topk3,decoupled_topk10",
        help="comma-separated; also decoupled_topk3_int4, decoupled_topk5_int4, decoupled_topk3_rotate10, "
        "decoupled_h4, decoupled_topk1_int4_h4, decoupled_topk3_int4_h4, decoupled_topk3_int4_h8, "
        "decoupled_4k2_2_h4, decoupled_4k2_3_h4, decoupled_4k4_3_h4, and union_* (see union_variant)",
    )
    parser.add_argument(
        "--combine", nargs="+", metavar="JSON", help="merge these quality.json files into DIR"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.combine:
        combine(args.combine, out)
        return 0
    base = RunManifest.load(args.manifest)
    corpus = load_corpus(base.data)
    m = args.learners
    per_step = base.diloco.batch_size * base.model.block_size
    tokens = args.tokens or 1500 * m * per_step
    speeds = SPEEDS[:m] if m <= len(SPEEDS) else tuple(1.0 + (i % 4) / 3 for i in range(m))
    manifests = {
        "diloco_sync": dataclasses.replace(base, diloco=dataclasses.replace(base.diloco, min_quorum=m)),
        "decoupled": base,
        "decoupled_fp32": dataclasses.replace(base, wire=dataclasses.replace(base.wire, codec="fp32")),
        "decoupled_topk1": sparse(base, "topk-int8", 0.01),
        "decoupled_topk3": sparse(base, "topk-int8", 0.03),
        "decoupled_topk10": sparse(base, "topk-int8", 0.10),
        "decoupled_topk3_int4": sparse(base, "topk-int4", 0.03),
        "decoupled_topk5_int4": sparse(base, "topk-int4", 0.05),
        "decoupled_topk3_rotate10": sparse(base, "topk-int8", 0.03, term_rounds=10),
        "decoupled_h4": sparse(base, "int8", base.wire.density, inner_steps=4),
        "decoupled_topk1_int4_h4": sparse(base, "topk-int4", 0.01, inner_steps=4),
        "decoupled_topk3_int4_h4": sparse(base, "topk-int4", 0.03, inner_steps=4),
        "decoupled_topk3_int4_h8": sparse(base, "topk-int4", 0.03, inner_steps=8),
        "decoupled_topk3_decay90": sparse(base, "topk-int8", 0.03, feedback_decay=0.9),
        "decoupled_topk3_decay95": sparse(base, "topk-int8", 0.03, feedback_decay=0.95),
        "decoupled_topk1_decay90": sparse(base, "topk-int8", 0.01, feedback_decay=0.9),
        "decoupled_topk3_int4_h4_decay90": sparse(base, "topk-int4", 0.03, inner_steps=4, feedback_decay=0.9),
        # SparseLoCo's compressor (wire.chunked), still merged and re-sparsified by the synchronizer
        "decoupled_4k2_2_h4": sparse(base, "topk4k-int2", 0.02, inner_steps=4, feedback_decay=0.95),
        "decoupled_4k2_3_h4": sparse(base, "topk4k-int2", 0.03, inner_steps=4, feedback_decay=0.95),
        "decoupled_4k4_3_h4": sparse(base, "topk4k-int4", 0.03, inner_steps=4, feedback_decay=0.95),
    }
    seeds = [int(x) for x in args.seeds.split(",")]
    names = args.variants.split(",")
    for name in names:  # every name checked before the first run
        if name.startswith("union_"):
            try:
                manifests[name] = union_variant(base, name)
            except ValueError as exc:
                parser.error(f"{name}: {exc}")
        elif name not in manifests and name != "dp":
            parser.error(f"unknown variant {name!r}")
    results: dict[str, dict] = {}
    for name in names:
        runs = []
        for seed in seeds:
            start = time.perf_counter()
            if name == "dp":
                run = run_dp(base, corpus, m, tokens, eval_points=12)
            elif name == "diloco_sync":
                run = run_swarm(manifests[name], corpus, m, tokens, (1.0,) * m, seed=seed)
            else:
                run = run_swarm(manifests[name], corpus, m, tokens, speeds, seed=seed)
            run["seconds"] = time.perf_counter() - start
            run["seed"] = seed
            runs.append(run)
            wire = run.get("wire", {})
            shown = (
                f" up {wire['up_bytes_per_param_round']:.4f} down {wire['down_bytes_per_param_round']:.4f} "
                f"B/param/round, up {wire['up_bytes_per_param_step']:.4f} B/param/step"
                if wire
                else ""
            )
            print(
                f"{name:24s} seed {seed} loss {run['final_eval_loss']:.4f}{shown} ({run['seconds']:.0f} s)",
                flush=True,
            )
        results[name] = runs[0] if len(runs) == 1 else over_seeds(runs)
        if len(runs) > 1:
            r = results[name]
            print(
                f"{name:24s} mean {r['final_eval_loss']:.4f} spread {r['spread']:.4f} over seeds {seeds}",
                flush=True,
            )
    write_summary(results, m, tokens, out)
    return 0


def write_summary(results: dict[str, dict], learners: int, tokens: int, out: Path) -> None:
    """DIR/quality.json (the variants, and each one's final loss relative to dp, fp32 and int8 where those
    ran) and DIR/quality.png."""
    summary = {"learners": learners, "tokens": tokens, "variants": results}
    if "dp" in results and "decoupled" in results:
        summary["decoupled_vs_dp"] = (
            results["decoupled"]["final_eval_loss"] / results["dp"]["final_eval_loss"] - 1
        )
    if "decoupled" in results and "decoupled_fp32" in results:
        summary["int8_vs_fp32"] = (
            results["decoupled"]["final_eval_loss"] / results["decoupled_fp32"]["final_eval_loss"] - 1
        )
    if "decoupled" in results:
        summary["vs_int8"] = {
            name: r["final_eval_loss"] / results["decoupled"]["final_eval_loss"] - 1
            for name, r in results.items()
            if name.startswith(("decoupled_", "union_"))
        }
    (out / "quality.json").write_text(json.dumps(summary, indent=2))
    plot(results, out / "quality.png")
    print(json.dumps({k: v for k, v in summary.items() if k != "variants"}))


def combine(paths: list[str], out: Path) -> None:
    """One quality.json and plot from several runs' (e.g. variants run in parallel), which must have the
    same learners and tokens."""
    results: dict[str, dict] = {}
    shapes = set()
    for path in paths:
        part = json.loads(Path(path).read_text())
        shapes.add((part["learners"], part["tokens"]))
        results.update(part["variants"])
    if len(shapes) != 1:
        raise SystemExit(f"--combine: the runs differ in (learners, tokens): {sorted(shapes)}")
    (learners, tokens) = shapes.pop()
    write_summary(results, learners, tokens, out)


def plot(results: dict[str, dict], path: Path) -> None:
    """Loss against tokens; with `decoupled` (int8) among the variants, a second panel shows each one's
    loss relative to int8's at the same eval point, so a gap that grows is visible."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reference = results.get("decoupled")
    rows = 2 if reference is not None and len(results) > 1 else 1
    fig, axes = plt.subplots(rows, 1, figsize=(7, 4.5 * rows), squeeze=False)
    ax = axes[0][0]
    colors = {}
    for name, r in results.items():
        xs, ys = zip(*r["curve"])
        (line,) = ax.plot(xs, ys, label=f"{name} ({r['final_eval_loss']:.3f})")
        colors[name] = line.get_color()
    ax.set_xlabel("training tokens (all learners)")
    ax.set_ylabel("eval loss (nats/byte)")
    ax.set_title("p2p_diloco quality at equal tokens")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    if rows == 2:
        ax = axes[1][0]
        ref = reference["curve"]
        for name, r in results.items():
            if name == "decoupled":
                continue
            points = list(zip(r["curve"], ref))
            gap = [100 * (a[1] / b[1] - 1) for a, b in points]
            ax.plot([a[0] for a, _ in points], gap, label=name, color=colors[name])
        ax.axhline(0.0, color="black", lw=0.8)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("training tokens (all learners)")
        ax.set_ylabel("eval loss vs decoupled (int8), %")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
