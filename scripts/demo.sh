#!/usr/bin/env bash
# The main job: creates .venv if missing, installs, runs `p2p-diloco demo` and prints its report.
#   scripts/demo.sh [demo options...]   e.g. scripts/demo.sh --learners 4 --out demo-out
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/_venv.sh"
cd "$ROOT"
exec "$VENV/bin/p2p-diloco" demo "$@"
