"""Benchmark of the wire codec: encode/decode time, frame size and relative error on 10M floats.

    .venv/bin/python scripts/bench_codec.py --out bench-out [--numel 10000000] [--repeats 3]

Writes OUT/codec.json. Data: standard normal and Student-t (df=3, heavy tails); codecs int8 (blockwise,
block 4096 and 256) and fp32. Times are the best of `--repeats` runs on this machine's CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from p2p_diloco.wire.codec import decode_tensors, encode_tensors
from p2p_diloco.wire.feedback import ErrorFeedback


def _best_seconds(fn, repeats: int) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def _case(values: torch.Tensor, codec: str, block_size: int, repeats: int) -> dict:
    tensors = {"x": values}
    encode_s, frame = _best_seconds(
        lambda: encode_tensors(tensors, codec=codec, block_size=block_size), repeats
    )
    decode_s, decoded = _best_seconds(lambda: decode_tensors(frame, max_bytes=len(frame)), repeats)
    error = float(torch.linalg.vector_norm(decoded["x"] - values) / torch.linalg.vector_norm(values))
    return {
        "codec": codec,
        "block_size": block_size if codec == "int8" else None,
        "frame_bytes": len(frame),
        "bytes_per_value": len(frame) / values.numel(),
        "encode_s": round(encode_s, 4),
        "decode_s": round(decode_s, 4),
        "encode_mvalues_per_s": round(values.numel() / encode_s / 1e6, 1),
        "decode_mvalues_per_s": round(values.numel() / decode_s / 1e6, 1),
        "relative_l2_error": error,
    }


def _error_feedback_drift(values: torch.Tensor, rounds: int) -> dict:
    """Relative error of the SUM of `rounds` decoded deltas (fresh noise each round), with and without EF."""
    generator = torch.Generator().manual_seed(1)
    numel = min(values.numel(), 1_000_000)
    out = {}
    for enabled in (True, False):
        feedback = ErrorFeedback(block_size=4096, enabled=enabled)
        true_sum = torch.zeros(numel, dtype=torch.float64)
        sent_sum = torch.zeros(numel, dtype=torch.float64)
        for _ in range(rounds):
            delta = values[:numel] * (0.5 + torch.rand(numel, generator=generator))
            true_sum += delta.double()
            sent_sum += feedback.compress(0, {"x": delta})[1]["x"].double()
        drift = float(torch.linalg.vector_norm(true_sum - sent_sum) / torch.linalg.vector_norm(true_sum))
        out["with_error_feedback" if enabled else "without_error_feedback"] = drift
    out.update(rounds=rounds, numel=numel)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--numel", type=int, default=10_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ef-rounds", type=int, default=20)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    generator = torch.Generator().manual_seed(0)
    data = {
        "normal": torch.randn(args.numel, generator=generator),
        "student_t_df3": torch.distributions.StudentT(3.0).sample((args.numel,)).float(),
    }
    encode_tensors({"warmup": torch.randn(4096)})  # first int8 call imports bitsandbytes (seconds)
    results = []
    for dist, values in data.items():
        for codec, block in (("int8", 4096), ("int8", 256), ("fp32", 0)):
            row = {"distribution": dist, "numel": args.numel, **_case(values, codec, block, args.repeats)}
            results.append(row)
            print(
                f"{dist:>14} {codec} block={row['block_size']}: {row['bytes_per_value']:.4f} B/value, "
                f"encode {row['encode_s'] * 1e3:.0f} ms, decode {row['decode_s'] * 1e3:.0f} ms, "
                f"rel. error {row['relative_l2_error']:.4f}"
            )
    drift = {dist: _error_feedback_drift(values, args.ef_rounds) for dist, values in data.items()}
    print("sum-of-deltas drift:", json.dumps(drift))
    report = {
        "machine": {
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
        "repeats": args.repeats,
        "results": results,
        "error_feedback_drift": drift,
    }
    (args.out / "codec.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out / 'codec.json'}")


if __name__ == "__main__":
    main()
