#!/usr/bin/env bash
# The main job: creates .venv if missing, installs, runs `p2p-diloco demo` and prints its report.
#   scripts/demo.sh                      a 90 s chaos run of 4 learners, then the lock-step baseline
#                                        under the same schedule (when `baseline-worker` is installed)
#   scripts/demo.sh [demo options...]    e.g. scripts/demo.sh --chaos --compare --duration 180 --out demo-out
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/_venv.sh"
cd "$ROOT"
if [ "$#" -eq 0 ]; then
    set -- --chaos --duration 90 --out demo-out
    if "$VENV/bin/p2p-diloco" baseline-worker --help >/dev/null 2>&1; then
        set -- "$@" --compare
    fi
fi
exec "$VENV/bin/p2p-diloco" demo "$@"
