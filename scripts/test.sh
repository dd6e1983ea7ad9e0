#!/usr/bin/env bash
# Runs the test suite: creates .venv if missing, installs with test extras, lints, runs pytest.
#   scripts/test.sh            all tiers (unit, sim, integration, slow)
#   scripts/test.sh --fast     unit + sim tiers without the slow marker (under a minute)
#   scripts/test.sh ARGS...    extra arguments go to pytest
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/_venv.sh" test
cd "$ROOT"
export PYTHONUNBUFFERED=1
"$VENV/bin/ruff" check p2p_diloco tests scripts
"$VENV/bin/ruff" format --check p2p_diloco tests scripts
ARGS=()
if [[ "${1:-}" == "--fast" ]]; then
    shift
    ARGS+=(-m "not slow and not integration")
fi
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "${ARGS[@]}" "$@"
