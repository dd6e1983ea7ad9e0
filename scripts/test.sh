#!/usr/bin/env bash
# Runs the test suite: creates .venv if missing, installs with test extras, lints, runs pytest.
#   scripts/test.sh            every tier but soak: unit, sim, slow, and the small real-process tier
#                              (integration, wan) that proves the wiring (what CI runs)
#   scripts/test.sh --fast     unit + sim tiers without the slow marker
#   scripts/test.sh --soak     only the soak tier, on demand (about 30 min on 2 cores): the real-process
#                              scenarios (failover, chaos, hostile peers, ...) that CI leaves to tests/sim
#   scripts/test.sh ARGS...    extra arguments go to pytest (a later -m replaces the tier's)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/_venv.sh" test
# The wan tier (tests/wan) needs root, iproute2, iptables and ping, the dashboard's browser test Chromium;
# when root, install what is missing (best effort: without them those tests skip with the reason).
if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    missing=()
    command -v ip >/dev/null 2>&1 || missing+=(iproute2)
    command -v iptables >/dev/null 2>&1 || missing+=(iptables)
    command -v ping >/dev/null 2>&1 || missing+=(iputils-ping)
    # the dashboard's browser test (tests/integration/test_dashboard.py) loads the page in headless Chromium
    command -v chromium >/dev/null 2>&1 || missing+=(chromium)
    if ((${#missing[@]})); then
        echo "installing ${missing[*]} for the wan tier and the browser test" >&2
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}") >/dev/null 2>&1 \
            || echo "could not install ${missing[*]}: the tests that need them will skip" >&2
    fi
fi
cd "$ROOT"
export PYTHONUNBUFFERED=1
"$VENV/bin/ruff" check p2p_diloco tests scripts
"$VENV/bin/ruff" format --check p2p_diloco tests scripts
PYTEST=("$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=25)
# The in-process tiers (unit, sim) run on two workers (pytest-xdist): they are CPU-bound, one torch thread
# each, and independent. The real-process tier runs alone after them: its peers need the cores to keep
# their heartbeats and leases on time.
IN_PROCESS=(-n 2 tests/unit tests/sim)
case "${1:-}" in
    --fast) shift; OMP_NUM_THREADS=1 exec "${PYTEST[@]}" -m "not slow and not integration and not soak" "${IN_PROCESS[@]}" "$@" ;;
    --soak) shift; exec "${PYTEST[@]}" -m "soak" "$@" ;;
esac
if (($#)); then  # a selection of one's own: one run, soak left out unless a later -m says otherwise
    exec "${PYTEST[@]}" -m "not soak" "$@"
fi
# the slowest tests are listed at the end of each run, so a run near its time budget shows where time went
OMP_NUM_THREADS=1 "${PYTEST[@]}" -m "not soak" "${IN_PROCESS[@]}"
exec "${PYTEST[@]}" -m "not soak" tests/integration tests/wan tests/gpu
