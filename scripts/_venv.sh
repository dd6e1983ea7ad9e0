# Sourced by scripts/demo.sh and scripts/test.sh: creates .venv if missing and installs the project.
# torch is pinned to the CPU build first, so the project's torch requirement never pulls a CUDA build;
# the rest is installed at the tested versions of constraints.txt.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
VENV="$ROOT/.venv"
EXTRAS="${1:-}"
if [[ ! -x "$VENV/bin/python" ]]; then
    echo "creating $VENV with $PY" >&2
    "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.installed${EXTRAS:+-$EXTRAS}"
# setup.py and the C kernels it builds (p2p_diloco/protocol/_fused.c) count too: an editable install
# compiles them only when pip runs.
if [[ ! -f "$STAMP" || "$ROOT/pyproject.toml" -nt "$STAMP" || "$ROOT/constraints.txt" -nt "$STAMP" \
      || "$ROOT/setup.py" -nt "$STAMP" \
      || "$ROOT/p2p_diloco/protocol/_fused.c" -nt "$STAMP" ]]; then
    "$VENV/bin/pip" install -q --disable-pip-version-check "torch==${P2P_DILOCO_TORCH:-2.13.0}" 2>&1 | grep -v "is ignored" || true
    "$VENV/bin/pip" install -q --disable-pip-version-check -c "$ROOT/constraints.txt" \
        -e "$ROOT${EXTRAS:+[$EXTRAS]}" 2>&1 | grep -v "is ignored" || true
    "$VENV/bin/python" -c "import p2p_diloco, torch, hivemind, bitsandbytes" 2>/dev/null \
        || { echo "install failed: see pip output above" >&2; exit 1; }
    touch "$STAMP"
fi
