"""Inner-step throughput: the byte-level GPT (AdamW steps/s), or an HF manifest's model (tokens/s).

Default: each step is forward + backward + AdamW on a batch from `BatchSampler` over the builtin corpus,
for a few GPT configs and thread counts. With `--hf MANIFEST` (e.g. peers/llama-tiny.toml) it builds
that manifest's model and times `model.trainer.InnerTrainer` steps on random tokens (throughput does not
depend on the text) in four variants: fp32 / bf16 autocast, without / with activation checkpointing.
Prints one line per measurement and writes JSON (default bench-out/bench_model.json).

    .venv/bin/python scripts/bench_model.py [--steps 60] [--threads 1 2] [--out PATH]
    .venv/bin/python scripts/bench_model.py --hf peers/llama-tiny.toml [--device cuda] [--batch-size 4]
        [--block-size 128] [--steps 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from p2p_diloco.config import DataConfig, ModelConfig, RunManifest, TrainConfig
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


class RandomTokens:
    """Batches of uniformly random token ids (a fixed generator)."""

    def __init__(self, vocab: int, batch_size: int, block_size: int):
        self.shape, self.vocab = (batch_size, block_size + 1), vocab
        self.generator = torch.Generator().manual_seed(0)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        data = torch.randint(0, self.vocab, self.shape, generator=self.generator)
        return data[:, :-1], data[:, 1:]


def measure_hf(manifest: RunManifest, args: argparse.Namespace) -> list[dict]:
    """Inner tokens/s of the manifest's model for fp32/bf16 x activation checkpointing off/on."""
    from p2p_diloco.model.trainer import InnerTrainer

    block = args.block_size or manifest.model.block_size
    batch = args.batch_size or manifest.diloco.batch_size
    vocab = int(manifest.model.resolved_config.get("vocab_size", 256))
    rows = []
    for precision in ("fp32", "bf16"):
        for checkpointing in (False, True):
            model = build_model(manifest.model).to(args.device)
            optimizer = make_inner_optimizer(
                model, manifest.diloco.inner_lr, manifest.diloco.inner_weight_decay
            )
            cfg = TrainConfig(precision=precision, activation_checkpointing=checkpointing, loss_every=10**9)
            trainer = InnerTrainer(
                cfg, model, optimizer, RandomTokens(vocab, batch, block), device=args.device
            )
            for _ in range(args.warmup):
                trainer.step()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.steps):
                trainer.step()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            row = {
                "config": f"{manifest.run_id} {precision} checkpointing={checkpointing}",
                "params": sum(p.numel() for p in model.parameters()),
                "batch_size": batch,
                "block_size": block,
                "device": args.device,
                "steps_per_s": args.steps / elapsed,
                "tokens_per_s": args.steps * batch * block / elapsed,
            }
            rows.append(row)
            print(f"{row['config']:48s} {row['steps_per_s']:7.2f} steps/s {row['tokens_per_s']:9.0f} tok/s")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", default="bench-out/bench_model.json")
    parser.add_argument("--hf", default=None, metavar="MANIFEST", help="time this manifest's model instead")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--batch-size", type=int, default=0, help="--hf: sequences a step (default: manifest)"
    )
    parser.add_argument(
        "--block-size", type=int, default=0, help="--hf: tokens a sequence (default: manifest)"
    )
    args = parser.parse_args()

    results = []
    meta = {"torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count()}
    if args.hf:
        torch.set_num_threads(args.threads[0])
        results = measure_hf(RunManifest.load(args.hf), args)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps({"meta": {**meta, "threads": args.threads[0]}, "results": results}, indent=2)
        )
        print(f"wrote {out}")
        return
    train = load_corpus(DataConfig()).train
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
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
