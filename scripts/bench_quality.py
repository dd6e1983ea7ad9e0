#!/usr/bin/env python
"""Quality benchmark: eval loss at equal total tokens for data-parallel and three DiLoCo variants.

    .venv/bin/python scripts/bench_quality.py --out bench-out [--learners 4] [--tokens N] [--seed 0]

Variants (all on the embedded corpus, the same tiny GPT, the same total number of training tokens):
  dp              one learner, M x batch, plain AdamW (the data-parallel reference)
  diloco_sync     M learners of equal speed, minimum quorum K = M
  decoupled       M learners of unequal speed (1, 1, 1.5, 2 fake s/step ...), K = 1 with the grace window
  decoupled_fp32  as decoupled, with fp32 instead of int8 deltas and updates
Writes DIR/quality.json (final_eval_loss, tokens, bytes_sent per variant, curves) and DIR/quality.png.
Targets reported, not asserted: decoupled within 2 % of dp; int8 within 1 % of fp32.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from p2p_diloco.config import RunManifest
from p2p_diloco.model.data import BatchSampler, evaluate, load_corpus
from p2p_diloco.model.gpt import build_model, make_inner_optimizer
from p2p_diloco.swarm.inprocess import InProcessSwarm, SwarmSpec

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


def run_swarm(manifest: RunManifest, corpus, learners: int, tokens: int, speeds: tuple[float, ...]) -> dict:
    per_step = manifest.diloco.batch_size * manifest.model.block_size
    mean_speed = sum(speeds) / len(speeds)
    fake_duration = tokens / per_step / learners * mean_speed
    spec = SwarmSpec(
        manifest=manifest,
        learners=learners,
        step_times=speeds,
        total_tokens=tokens,
        eval_every=max(1.0, fake_duration / 12),
    )
    report = InProcessSwarm(spec, corpus=corpus).run()
    return {
        "final_eval_loss": report.final_eval_loss,
        "tokens": report.tokens,
        "bytes_sent": report.bytes_sent,
        "versions": list(report.versions),
        "goodput": report.goodput,
        "digests_equal": report.digests_equal,
        "curve": [(tok, loss) for _, tok, loss in report.eval_curve],
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=None, help="total tokens per variant")
    parser.add_argument("--manifest", default="peers/demo.toml")
    parser.add_argument("--variants", default="dp,diloco_sync,decoupled,decoupled_fp32")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
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
    }
    results: dict[str, dict] = {}
    for name in args.variants.split(","):
        start = time.perf_counter()
        if name == "dp":
            results[name] = run_dp(base, corpus, m, tokens, eval_points=12)
        elif name == "diloco_sync":
            results[name] = run_swarm(manifests[name], corpus, m, tokens, (1.0,) * m)
        elif name in manifests:
            results[name] = run_swarm(manifests[name], corpus, m, tokens, speeds)
        else:
            parser.error(f"unknown variant {name!r}")
        results[name]["seconds"] = time.perf_counter() - start
        print(
            f"{name:15s} loss {results[name]['final_eval_loss']:.4f} ({results[name]['seconds']:.0f} s)",
            flush=True,
        )
    summary = {"learners": m, "tokens": tokens, "variants": results}
    if "dp" in results and "decoupled" in results:
        summary["decoupled_vs_dp"] = (
            results["decoupled"]["final_eval_loss"] / results["dp"]["final_eval_loss"] - 1
        )
    if "decoupled" in results and "decoupled_fp32" in results:
        summary["int8_vs_fp32"] = (
            results["decoupled"]["final_eval_loss"] / results["decoupled_fp32"]["final_eval_loss"] - 1
        )
    (out / "quality.json").write_text(json.dumps(summary, indent=2))
    plot(results, out / "quality.png")
    print(json.dumps({k: v for k, v in summary.items() if k != "variants"}))
    return 0


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in results.items():
        xs, ys = zip(*r["curve"])
        ax.plot(xs, ys, label=f"{name} ({r['final_eval_loss']:.3f})")
    ax.set_xlabel("training tokens (all learners)")
    ax.set_ylabel("eval loss (nats/byte)")
    ax.set_title("p2p_diloco quality at equal tokens")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
