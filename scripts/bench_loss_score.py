#!/usr/bin/env python
"""The cost of the loss check and score (issue #41 item 2): milliseconds per scored delta on this CPU, against
the time a round of the manifest's model takes to come round.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_loss_score.py [--manifest peers/demo.toml] \
        [--score-batch 16,64] [--deltas 4] [--rounds 20] [--out DIR]

Builds the manifest's model, fragment plan and replica as a peer does and the holder's `LossProbe`
(`model.probe`, the loss check on), then for `--rounds` rounds of `--deltas` deltas of one fragment (AdamW-sized
random deltas: the cost does not depend on their values) times `LossProbe.measure` on a fresh seed per round:
one forward pass of `score_batch` windows for the round's base, one per delta. Reports per score batch the
milliseconds per round (median), per delta (a round of all the deltas less a round of one, over the deltas
but one) and for the base (a round of one less one delta), and, for
scale, one inner AdamW step of the manifest's batch on the same threads and H of them (a learner sends a
delta of each fragment every H steps, so a round of one fragment comes about every H steps), and the median
standard error of a delta's loss change on its batch, relative to the loss (the noise rule 2 of
`protocol.loss_score` measures against; of these random deltas at the initial weights). Times are
this process's CPU time unless `--clock wall` (on a shared machine others' load inflates wall time, not CPU
time). Writes DIR/loss_score.json when `--out` is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from p2p_diloco.config import RunManifest
from p2p_diloco.model.data import BatchSampler, load_corpus
from p2p_diloco.model.gpt import build_model, make_inner_optimizer
from p2p_diloco.model.probe import loss_probe_for
from p2p_diloco.protocol.fragments import plan_fragments
from p2p_diloco.protocol.loss_score import score_seed
from p2p_diloco.protocol.replica import GlobalReplica

# `--clock`: CPU seconds of this process by default (others' load barely moves it)
CLOCK = [time.process_time]


def step_ms(manifest: RunManifest, corpus, steps: int = 10) -> float:  # noqa: ANN001
    """Milliseconds of one inner AdamW step of the manifest's batch (median of `steps` after a warm-up)."""
    model = build_model(manifest.model)
    d = manifest.diloco
    optimizer = make_inner_optimizer(model, d.inner_lr, 0.0)
    sampler = BatchSampler(
        corpus.train,
        block_size=manifest.model.block_size,
        batch_size=d.batch_size,
        shard=0,
        num_shards=1,
        seed=0,
    )
    times = []
    for i in range(steps + 2):
        x, y = sampler.next_batch()
        start = CLOCK[0]()
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(CLOCK[0]() - start)
    return 1000 * statistics.median(times)


def measure(manifest: RunManifest, corpus, *, deltas: int, rounds: int) -> dict:  # noqa: ANN001
    model = build_model(manifest.model)
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    plan = plan_fragments(shapes, manifest.diloco.fragments)
    replica = GlobalReplica(plan, {n: p.detach().clone() for n, p in model.named_parameters()})
    probe = loss_probe_for(manifest, replica, corpus.eval)
    assert probe is not None
    d = manifest.diloco
    gen = torch.Generator().manual_seed(0)
    rms = d.inner_lr * d.inner_steps  # about what AdamW moves a coordinate in H steps
    fragment = max(
        range(plan.num_fragments), key=lambda p: sum(replica.params_view(p)[n].numel() for n in plan.names(p))
    )
    params = replica.params_view(fragment)
    payloads = [
        {n: torch.randn(params[n].shape, generator=gen) * rms for n in plan.names(fragment)}
        for _ in range(deltas)
    ]
    probe.measure(payloads[:1], b"warm-up")
    noise: list[float] = []  # each delta's standard error, relative to the batch's loss
    alone, full = [], []  # rounds of one delta and of all: the difference over deltas - 1 is one delta's cost
    for r in range(rounds + 1):
        for batch, times in ((payloads[:1], alone), (payloads, full)):
            seed = score_seed(manifest.run_id, fragment, r, len(batch), [bytes([r])])
            start = CLOCK[0]()
            changes = probe.measure(batch, seed)
            times.append(CLOCK[0]() - start)
            noise += [c.stderr / c.base for c in changes]
    round_ms = 1000 * statistics.median(full[1:])
    one_ms = 1000 * statistics.median(alone[1:])
    delta_ms = (round_ms - one_ms) / max(1, deltas - 1)
    return {
        "score_batch": probe.windows,
        "deltas_per_round": deltas,
        "fragment": fragment,
        "fragment_params": sum(params[n].numel() for n in plan.names(fragment)),
        "ms_per_round": round_ms,
        "ms_base": one_ms - delta_ms,
        "ms_per_delta": delta_ms,
        "median_relative_stderr": statistics.median(noise),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--manifest", default="peers/demo.toml")
    parser.add_argument("--score-batch", default="", help="comma-separated; default: the manifest's")
    parser.add_argument("--deltas", type=int, default=4, help="scored deltas per round")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="")
    parser.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu: this process's CPU time (default: robust on a shared machine); wall: elapsed time",
    )
    args = parser.parse_args()
    CLOCK[0] = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    base = RunManifest.load(args.manifest)
    base = dataclasses.replace(base, robust=dataclasses.replace(base.robust, loss_check="on"))
    corpus = load_corpus(base.data)
    sizes = [int(x) for x in args.score_batch.split(",") if x] or [base.robust.score_batch]
    step = step_ms(base, corpus)
    h = base.diloco.inner_steps
    results = []
    for size in sizes:
        manifest = dataclasses.replace(base, robust=dataclasses.replace(base.robust, score_batch=size))
        r = measure(manifest, corpus, deltas=args.deltas, rounds=args.rounds)
        r["share_of_h_steps"] = r["ms_per_round"] / (h * step)
        results.append(r)
        print(
            f"score_batch {size}: {r['ms_per_delta']:.2f} ms per delta, base {r['ms_base']:.2f} ms, "
            f"{r['ms_per_round']:.2f} ms per round of {args.deltas} deltas = "
            f"{r['share_of_h_steps']:.1%} of H = {h} inner steps ({step:.1f} ms each, batch "
            f"{base.diloco.batch_size} x {base.model.block_size}); a delta's standard error "
            f"{r['median_relative_stderr']:.3%} of the loss (median)",
            flush=True,
        )
    summary = {
        "manifest": args.manifest,
        "threads": args.threads,
        "clock": args.clock,
        "inner_step_ms": step,
        "inner_steps": h,
        "results": results,
    }
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "loss_score.json").write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
