#!/usr/bin/env python3
"""WAN emulator for p2p_diloco tests and benchmarks (needs root): see `p2p_diloco.wan.cli` and docs/wan.md.

sudo .venv/bin/python scripts/wan_emulator.py start a:25:20 b:25:20 n:25:20:nat
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # usable without installing the package

from p2p_diloco.wan.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
