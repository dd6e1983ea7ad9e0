#!/usr/bin/env python
"""Does keeping dense error-feedback residuals in bfloat16 cost quality (issue #14)?

    .venv/bin/python scripts/bench_feedback_dtype.py --out DIR [--learners 4] [--tokens N]

Runs `bench_quality`'s `decoupled` variant (int8 deltas and updates, learners of unequal speed, the same
tokens) three times, changing only how `wire.codecs.feedback.ErrorFeedback` keeps its residuals:

  float32          the residuals in float32 (as before issue #14)
  float32_probe    float32, each stored residual scaled by (1 + 1e-6) after every delta: a change far
                   below bfloat16's rounding, to show how far the run's own chaos moves the final loss
  bfloat16         the residuals in bfloat16 (the default for dense codecs)

Writes DIR/feedback_dtype.json (final eval loss of each, and each against float32) and
DIR/feedback_dtype.png (the eval curves).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_quality  # noqa: E402

from p2p_diloco.config import RunManifest  # noqa: E402
from p2p_diloco.model.data import load_corpus  # noqa: E402
from p2p_diloco.wire.codecs.feedback import ErrorFeedback  # noqa: E402

PROBE_SCALE = 1 + 1e-6


@contextmanager
def residuals(dtype: torch.dtype, probe: bool = False) -> Iterator[None]:
    """Every `ErrorFeedback` built inside keeps its residuals in `dtype` (and, with `probe`, scales them
    by PROBE_SCALE after each delta)."""
    init, compress = ErrorFeedback.__init__, ErrorFeedback.compress

    def patched_init(self, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        init(self, *args, **kwargs)
        self.residual_dtype = dtype

    def patched_compress(self, fragment, delta):  # noqa: ANN001, ANN202
        out = compress(self, fragment, delta)
        for tensor in self._residuals.get(fragment, {}).values():
            tensor.mul_(PROBE_SCALE)
        return out

    ErrorFeedback.__init__ = patched_init
    if probe:
        ErrorFeedback.compress = patched_compress
    try:
        yield
    finally:
        ErrorFeedback.__init__, ErrorFeedback.compress = init, compress


VARIANTS = {
    "float32": (torch.float32, False),
    "float32_probe": (torch.float32, True),
    "bfloat16": (torch.bfloat16, False),
}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=None, help="total tokens per variant")
    parser.add_argument("--manifest", default="peers/demo.toml")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = RunManifest.load(args.manifest)
    if manifest.wire.codec.sparse:
        raise SystemExit(
            f"{args.manifest}: codec {manifest.wire.codec} is sparse; this compares dense codecs"
        )
    corpus = load_corpus(manifest.data)
    m = args.learners
    tokens = args.tokens or 1500 * m * manifest.diloco.batch_size * manifest.model.block_size
    speeds = bench_quality.SPEEDS[:m] if m <= len(bench_quality.SPEEDS) else (1.0,) * m
    results: dict[str, dict] = {}
    for name, (dtype, probe) in VARIANTS.items():
        start = time.perf_counter()
        with residuals(dtype, probe):
            results[name] = bench_quality.run_swarm(manifest, corpus, m, tokens, speeds)
        results[name]["seconds"] = round(time.perf_counter() - start, 1)
        print(
            f"{name:14s} loss {results[name]['final_eval_loss']:.4f} ({results[name]['seconds']:.0f} s)",
            flush=True,
        )
    base = results["float32"]["final_eval_loss"]
    summary = {
        "command": " ".join(["scripts/bench_feedback_dtype.py", *sys.argv[1:]]),
        "learners": m,
        "tokens": tokens,
        "codec": str(manifest.wire.codec),
        "final_eval_loss": {name: r["final_eval_loss"] for name, r in results.items()},
        "vs_float32": {name: r["final_eval_loss"] / base - 1 for name, r in results.items()},
        "variants": results,
    }
    (out / "feedback_dtype.json").write_text(json.dumps(summary, indent=2))
    bench_quality.plot(results, out / "feedback_dtype.png")
    print(json.dumps({k: summary[k] for k in ("final_eval_loss", "vs_float32")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
