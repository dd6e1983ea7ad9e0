"""Benchmark of the wire codecs: encode/decode time, frame size and relative error.

    .venv/bin/python scripts/bench_codec.py --out bench-out [--numel 10000000] [--repeats 3]
    .venv/bin/python scripts/bench_codec.py --out bench-out --sparse [--numel 4194304] [--densities 0.01,0.02,0.03]

Writes OUT/codec.json. Data: standard normal and Student-t (df=3, heavy tails); codecs int8 (blockwise,
block 4096 and 256) and fp32. Times are the best of `--repeats` runs on this machine's CPU.

`--sparse` writes OUT/sparse_codec.json and OUT/sparse_codec.png instead: every sparse codec (`topk-int8`,
`topk-int4`, `topk4k-int2`, `topk4k-int4`, `topk4k-int8`, block 4096) at each density, with bytes per
value, the relative L2 error of the whole tensor (what one frame leaves out: sparsification and
quantization), the relative error over the kept entries only (quantization), and the drift of the sum of
`--ef-rounds` error-fed frames (decay 1.0: what error feedback has not yet delivered).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from p2p_diloco.wire.codecs.codec import decode_sparse, decode_tensors, encode_tensors
from p2p_diloco.wire.codecs.feedback import ErrorFeedback


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


SPARSE_CODECS = ("topk-int8", "topk-int4", "topk4k-int8", "topk4k-int4", "topk4k-int2")


def _sparse_case(values: torch.Tensor, codec: str, density: float, repeats: int, rounds: int) -> dict:
    tensors = {"x": values}
    encode_s, frame = _best_seconds(lambda: encode_tensors(tensors, codec=codec, density=density), repeats)
    decode_s, decoded = _best_seconds(lambda: decode_tensors(frame, max_bytes=len(frame)), repeats)
    kept = decode_sparse(frame, max_bytes=len(frame))["x"].indices
    norm = float(torch.linalg.vector_norm(values))
    generator = torch.Generator().manual_seed(2)
    feedback = ErrorFeedback(codec, 4096, density=density, decay=1.0)
    true_sum = torch.zeros(values.numel(), dtype=torch.float64)
    sent_sum = torch.zeros(values.numel(), dtype=torch.float64)
    for _ in range(rounds):
        delta = values * (0.5 + torch.rand(values.numel(), generator=generator))
        true_sum += delta.double()
        sent_sum += feedback.compress(0, {"x": delta})[1]["x"].double()
    return {
        "codec": codec,
        "density": density,
        "frame_bytes": len(frame),
        "bytes_per_value": len(frame) / values.numel(),
        "kept_fraction": kept.numel() / values.numel(),
        "relative_l2_error": float(torch.linalg.vector_norm(decoded["x"] - values)) / norm,
        "kept_relative_l2_error": float(
            torch.linalg.vector_norm(decoded["x"][kept] - values[kept])
            / torch.linalg.vector_norm(values[kept])
        ),
        "sum_drift_after_rounds": float(
            torch.linalg.vector_norm(true_sum - sent_sum) / torch.linalg.vector_norm(true_sum)
        ),
        "rounds": rounds,
        "encode_s": round(encode_s, 4),
        "decode_s": round(decode_s, 4),
    }


def _sparse_plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dists = sorted({r["distribution"] for r in results})
    fig, axes = plt.subplots(1, len(dists), figsize=(6 * len(dists), 4.5), squeeze=False)
    for ax, dist in zip(axes[0], dists):
        for codec in SPARSE_CODECS:
            rows = sorted(
                (r for r in results if r["distribution"] == dist and r["codec"] == codec),
                key=lambda r: r["density"],
            )
            ax.plot(
                [r["bytes_per_value"] for r in rows],
                [r["kept_relative_l2_error"] for r in rows],
                "o-",
                label=codec,
            )
            for r in rows:
                ax.annotate(
                    f"{r['density']:.0%}", (r["bytes_per_value"], r["kept_relative_l2_error"]), fontsize=7
                )
        ax.set_xlabel("bytes per parameter per frame")
        ax.set_ylabel("relative L2 error over the kept entries")
        ax.set_yscale("log")
        ax.set_title(f"{dist}: sparse codecs (labels: density)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def sparse_main(args: argparse.Namespace, data: dict[str, torch.Tensor]) -> None:
    results = []
    for dist, values in data.items():
        for codec in SPARSE_CODECS:
            for density in args.densities:
                row = {
                    "distribution": dist,
                    "numel": values.numel(),
                    **_sparse_case(values, codec, density, args.repeats, args.ef_rounds),
                }
                results.append(row)
                print(
                    f"{dist:>14} {codec:>12} {density:.0%}: {row['bytes_per_value']:.4f} B/value, "
                    f"error {row['relative_l2_error']:.3f} (kept {row['kept_relative_l2_error']:.4f}), "
                    f"drift after {args.ef_rounds} {row['sum_drift_after_rounds']:.4f}, "
                    f"encode {row['encode_s'] * 1e3:.0f} ms, decode {row['decode_s'] * 1e3:.0f} ms"
                )
    report = {
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "repeats": args.repeats,
        "results": results,
    }
    (args.out / "sparse_codec.json").write_text(json.dumps(report, indent=2) + "\n")
    _sparse_plot(results, args.out / "sparse_codec.png")
    print(f"wrote {args.out / 'sparse_codec.json'} and sparse_codec.png")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--numel", type=int, default=10_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ef-rounds", type=int, default=20)
    parser.add_argument("--sparse", action="store_true", help="the sparse codecs instead (see above)")
    parser.add_argument("--densities", default="0.01,0.02,0.03", help="with --sparse: comma-separated")
    args = parser.parse_args()
    args.densities = [float(d) for d in args.densities.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)

    generator = torch.Generator().manual_seed(0)
    data = {
        "normal": torch.randn(args.numel, generator=generator),
        "student_t_df3": torch.distributions.StudentT(3.0).sample((args.numel,)).float(),
    }
    if args.sparse:
        sparse_main(args, data)
        return
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
