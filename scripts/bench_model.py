"""Inner-step throughput of the byte-level GPT: AdamW steps per second for a few configs and thread counts.

Each step is forward + backward + AdamW on a batch from `BatchSampler` over the builtin corpus.
Prints one line per measurement and writes JSON (default bench-out/bench_model.json).

    .venv/bin/python scripts/bench_model.py [--steps 60] [--threads 1 2] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from p2p_diloco.config import DataConfig, ModelConfig
from p2p_diloco.model import BatchSampler, build_model, load_corpus, make_inner_optimizer

CONFIGS: dict[str, tuple[ModelConfig, int]] = {
    "default (2L 2H 64d, T=64, B=8)": (ModelConfig(), 8),
    "demo manifest (2L 2H 64d, T=64, B=32)": (ModelConfig(), 32),
    "4L 4H 128d, T=128, B=8": (ModelConfig(n_layer=4, n_head=4, n_embd=128, block_size=128), 8),
    "6L 6H 192d, T=128, B=8": (ModelConfig(n_layer=6, n_head=6, n_embd=192, block_size=128), 8),
}


def measure(cfg: ModelConfig, batch_size: int, train: torch.Tensor, steps: int, warmup: int) -> dict:
    model = build_model(cfg)
    optimizer = make_inner_optimizer(model, lr=3e-3, weight_decay=0.1)
    sampler = BatchSampler(
        train, block_size=cfg.block_size, batch_size=batch_size, shard=0, num_shards=1, seed=0
    )
    start = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            start = time.perf_counter()
        x, y = sampler.next_batch()
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    elapsed = time.perf_counter() - start
    return {
        "params": model.num_parameters(),
        "steps_per_s": steps / elapsed,
        "tokens_per_s": steps * batch_size * cfg.block_size / elapsed,
        "final_loss": float(loss.detach()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", default="bench-out/bench_model.json")
    args = parser.parse_args()

    train = load_corpus(DataConfig()).train
    results = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for label, (cfg, batch_size) in CONFIGS.items():
            row = {"config": label, "threads": threads, "batch_size": batch_size}
            row.update(measure(cfg, batch_size, train, args.steps, args.warmup))
            results.append(row)
            print(
                f"threads={threads} {label:32s} params={row['params']:>9,d} "
                f"{row['steps_per_s']:7.1f} steps/s {row['tokens_per_s']:9.0f} tok/s"
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count()}
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
