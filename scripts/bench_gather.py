#!/usr/bin/env python
"""The gather set of union rounds (issue #40 item 2): down bytes per sparse round as the swarm grows, with and
without a bound on the deltas a round lists.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_gather.py --learners 4,8,16 --gather 4,256 \
        --out docs/results/gather

Per (learners M, gather G) one run of the in-process swarm (whole `Peer` and `Learner` objects, fake clock,
deterministic by seed) on the sim tier's manifest (peers/demo.toml with the small model, H = 8, batch 8) under
`topk4k-int2` at 3 %, `--duration` fake seconds of 1 s steps. From every update a holder published: the
deltas it listed and left out, and its payload (the bundle of listed delta frames every peer downloads once
per round) in bytes per parameter of its fragment. Also the learners' steps merged / trained, whether every
replica ended bit-identical, and the final eval loss. Writes OUT/gather.json and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from pathlib import Path

import torch

from p2p_diloco.config import ModelConfig, RunManifest
from p2p_diloco.model.data import load_corpus
from p2p_diloco.protocol.messages import UpdateRecord
from p2p_diloco.swarm import effects as fx
from p2p_diloco.swarm.inprocess import InProcessSwarm, SwarmSpec


class Recording(InProcessSwarm):
    def __init__(self, spec: SwarmSpec, corpus) -> None:  # noqa: ANN001
        super().__init__(spec, corpus=corpus)
        self.records: list[UpdateRecord] = []

    def _observe(self, i: int, intent: fx.Intent) -> None:
        super()._observe(i, intent)
        if isinstance(intent, fx.Published):
            self.records.append(intent.record)


def manifest(gather: int) -> RunManifest:
    base = RunManifest.load("peers/demo.toml")
    return dataclasses.replace(
        base,
        model=ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=32),
        diloco=dataclasses.replace(base.diloco, inner_steps=8, batch_size=8, gather=gather),
        wire=dataclasses.replace(base.wire, codec="topk4k-int2", density=0.03),
    )


def run_one(learners: int, gather: int, duration: float, corpus) -> dict:  # noqa: ANN001
    started = time.perf_counter()
    swarm = Recording(SwarmSpec(manifest=manifest(gather), learners=learners, duration=duration), corpus)
    report = swarm.run()
    numel = [
        sum(math.prod(swarm.shapes[n]) for n in swarm.plan.names(p)) for p in range(swarm.plan.num_fragments)
    ]
    down = [len(r.payload) / numel[r.fragment] for r in swarm.records]
    listed = [len(r.deltas) for r in swarm.records]
    return {
        "learners": learners,
        "gather": gather,
        "rounds": len(swarm.records),
        "listed_mean": statistics.fmean(listed),
        "listed_max": max(listed),
        "left_out_rounds": sum(1 for r in swarm.records if r.left_out),
        "down_bytes_per_param_per_round_mean": statistics.fmean(down),
        "down_bytes_per_param_per_round_max": max(down),
        "steps_merged_fraction": sum(s.steps_merged for s in report.learners)
        / sum(s.steps for s in report.learners),
        "replicas_equal": report.digests_equal,
        "final_eval_loss": report.final_eval_loss,
        "wall_seconds": time.perf_counter() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--learners", default="4,8,16")
    parser.add_argument("--gather", default="4,256")
    parser.add_argument("--duration", type=float, default=40.0, help="fake seconds per run")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    corpus = load_corpus(manifest(20).data)
    rows = []
    for m in (int(x) for x in args.learners.split(",")):
        for g in (int(x) for x in args.gather.split(",")):
            row = run_one(m, g, args.duration, corpus)
            rows.append(row)
            print(
                f"M={m:3d} gather={g:3d}: {row['rounds']} rounds, listed mean {row['listed_mean']:.2f} max "
                f"{row['listed_max']}, left out in {row['left_out_rounds']}; down/round "
                f"{row['down_bytes_per_param_per_round_mean']:.3f} B/param (max "
                f"{row['down_bytes_per_param_per_round_max']:.3f}); merged {row['steps_merged_fraction']:.2f}; "
                f"equal {row['replicas_equal']}; loss {row['final_eval_loss']:.4f} ({row['wall_seconds']:.0f} s)",
                flush=True,
            )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gather.json").write_text(
        json.dumps({"duration": args.duration, "runs": rows}, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
