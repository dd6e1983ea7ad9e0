#!/usr/bin/env python
"""What a hot spare costs: start `join --standby` on a manifest, wait until it is prepared, measure its
process tree's PSS (the spare and torch's shared-memory manager), then dismiss it.

    scripts/measure_spare.py --out DIR [--manifest peers/demo.toml] [--repeats 3]

Writes DIR/spare.json: per repeat the seconds from launch to "standby: ready" and the PSS in MiB, and
their means. The spare touches no state directory and starts no DHT node, so nothing else is needed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_scale import tree_pss_kib

from p2p_diloco.net.identity import write_identity
from p2p_diloco.node.standby import READY

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT = 300.0


def measure_once(manifest: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="spare-") as tmp:
        identity, state_dir = Path(tmp) / "peer.key", Path(tmp) / "state"
        write_identity(identity)
        cmd = [sys.executable, "-m", "p2p_diloco", "join", str(manifest), "--identity", str(identity),
               "--state-dir", str(state_dir), "--standby"]  # fmt: skip
        started = time.monotonic()
        spare = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert spare.stdout is not None and spare.stdin is not None
        for line in spare.stdout:
            if line.strip() == READY:
                break
            if time.monotonic() - started > READY_TIMEOUT:
                spare.kill()
                raise RuntimeError(f"the spare was not ready within {READY_TIMEOUT:.0f} s")
        else:
            raise RuntimeError(f"the spare exited with {spare.wait()} before it was ready")
        ready = time.monotonic() - started
        pss_mib = tree_pss_kib(spare.pid) / 1024
        spare.stdin.close()  # end of input: the spare leaves having touched nothing
        code = spare.wait(timeout=60)
        if code != 0 or state_dir.exists():
            raise RuntimeError(
                f"the dismissed spare exited with {code} (state dir made: {state_dir.exists()})"
            )
        return {"ready_seconds": round(ready, 2), "pss_mib": round(pss_mib, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--manifest", default=str(ROOT / "peers" / "demo.toml"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    runs = [measure_once(Path(args.manifest)) for _ in range(args.repeats)]
    result = {
        "manifest": args.manifest,
        "runs": runs,
        "mean_pss_mib": round(statistics.mean(r["pss_mib"] for r in runs), 1),
        "mean_ready_seconds": round(statistics.mean(r["ready_seconds"] for r in runs), 2),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "spare.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
