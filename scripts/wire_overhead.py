#!/usr/bin/env python
"""Where a chunked sparse delta's up bytes go on a run's model: per fragment frame, the kept entries'
payload (12-bit offsets and 2/4/8-bit codes), the per-tensor scales (levels or absmax), the frame's fixed
head, and the delta frame's envelope (its JSON header and signature), against the ideal
density x numel x bytes per kept entry.

    .venv/bin/python scripts/wire_overhead.py [--manifest peers/demo.toml] [--codec topk4k-int2]
        [--densities 0.012,0.015,0.02] [--tensors]

Issue #30 measured the demo model's overhead with it (docs/results.md, "Where a sparse delta's bytes go").
The envelope is that of a signed delta of the in-process swarm (a 32-byte signature, as `bench_quality`
measures); a real node's RSA signature carries its public key too (several hundred bytes more).
"""

from __future__ import annotations

import argparse
import math

from p2p_diloco.config import RunManifest
from p2p_diloco.model.gpt import build_model
from p2p_diloco.protocol.fragments import plan_fragments
from p2p_diloco.protocol.messages import DeltaHeader
from p2p_diloco.wire.codecs import chunked
from p2p_diloco.wire.codecs.bitpack import packed12_size, packed_codes_size
from p2p_diloco.wire.codecs.codec import frame_size
from p2p_diloco.wire.codecs.sparse import chunk_keep
from p2p_diloco.wire.frames import encode_delta

HEAD = 10  # magic, version, codec id, tensor count


def envelope(manifest: RunManifest) -> int:
    """Bytes of a signed delta frame around its payload, with typical counters."""
    header = DeltaHeader(
        run_id=manifest.run_id,
        manifest_hash=manifest.manifest_hash,
        fragment=1,
        anchor_version=120,
        tokens=8192,
        steps=manifest.diloco.inner_steps,
        seq=121,
        since_seq=120,
        sender="",
        signature=b"\xff" * 32,
    )
    return len(encode_delta(header, b""))


def breakdown(shapes: dict[str, tuple[int, ...]], codec: str, density: float, block_size: int) -> dict:
    bits = chunked.VALUE_BITS[codec]
    keep_full = chunk_keep(chunked.CHUNK, density)
    rows, kept = [], 0
    scales = 0
    for name in sorted(shapes):
        numel = math.prod(shapes[name])
        full, rest = divmod(numel, chunked.CHUNK)
        k = full * keep_full + (chunked.short_keep(rest, keep_full) if rest else 0)
        s = chunked._scale_bytes(k, bits, block_size)
        rows.append((name, numel, k, density * numel, s))
        kept, scales = kept + k, scales + s
    payload = packed12_size(kept) + packed_codes_size(kept, bits)
    total = frame_size(shapes, codec=codec, block_size=block_size, density=density)
    fixed = total - payload - scales
    ideal = density * sum(r[1] for r in rows) * (1.5 + bits / 8)
    return {
        "rows": rows,
        "frame": total,
        "payload": payload,
        "scales": scales,
        "fixed": fixed,
        "ideal": ideal,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--manifest", default="peers/demo.toml")
    parser.add_argument("--codec", default="topk4k-int2", choices=sorted(chunked.VALUE_BITS))
    parser.add_argument("--densities", default="0.012,0.015,0.02")
    parser.add_argument("--tensors", action="store_true", help="also one line per tensor")
    args = parser.parse_args()
    manifest = RunManifest.load(args.manifest)
    named = [(n, tuple(p.shape)) for n, p in build_model(manifest.model).named_parameters()]
    plan = plan_fragments(named, manifest.diloco.fragments)
    shapes = dict(named)
    params = sum(math.prod(s) for _, s in named)
    env = envelope(manifest)
    print(
        f"{params} parameters, {len(named)} tensors, {plan.num_fragments} fragments; envelope {env} B a delta"
    )
    for density in (float(x) for x in args.densities.split(",")):
        parts = [
            breakdown({n: shapes[n] for n in plan.names(p)}, args.codec, density, manifest.wire.block_size)
            for p in range(plan.num_fragments)
        ]
        sums = {
            key: sum(part[key] for part in parts) for key in ("ideal", "payload", "scales", "fixed", "frame")
        }
        sums["envelope"] = env * len(parts)
        sums["up"] = sums["frame"] + sums["envelope"]
        print(
            f"density {density}: B/param/round " + ", ".join(f"{k} {v / params:.4f}" for k, v in sums.items())
        )
        if args.tensors:
            for p, part in enumerate(parts):
                for name, numel, k, ideal_k, s in part["rows"]:
                    print(
                        f"  fragment {p} {name:28s} {numel:7d} kept {k:4d} (ideal {ideal_k:7.1f}) scales {s} B"
                    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
