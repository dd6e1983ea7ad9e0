#!/usr/bin/env bash
# The GPU check (issue #33, docs/gpu.md): proves the CUDA path and measures what a volunteer needs.
#
#   scripts/gpu_check.sh [--out DIR] [--wheels DIR]      on a machine with an NVIDIA GPU (default out:
#                                                        docs/results/gpu); about 5-8 minutes on one H100
#   scripts/gpu_check.sh --cpu [--out DIR]               the same flow with --device cpu and tiny sizes
#                                                        (CI's dry run; default out: out/gpu-check-cpu)
#   scripts/gpu_check.sh --fetch-wheels DIR              here, with pip and an index: the wheels a GPU
#                                                        machine without an index needs (then --wheels DIR)
#   other options: --skip-tests, --skip-figures, --skip-run, --run-seconds N, --figures-budget S
#
# Steps, each printed as it starts: (1) find a Python whose torch sees CUDA (the project's .venv, then
# python3; none: install the CUDA build of torch and the project into a venv with pip, or stop saying
# why); (2) make hivemind, bitsandbytes and the rest importable (already there; else from --wheels DIR
# with pip --no-index --target; else pip from the index); (3) env.json; (4) pytest tests/gpu -m gpu
# (tests.log); (5) figures.json: tokens/s, peak GPU memory and host memory per parameter for the 13.8M
# llama example, a ~350M and a ~1B Llama; (6) realrun.json: a bootstrap and two joins on 127.0.0.1 (one
# on the GPU, one on the CPU) whose replicas must agree; (7) summary.json and summary.md. Everything the
# script prints also goes to gpu_check.log in the out folder. Exit status 0 only if every check passed.
#
# On this workplace's GPU machines (no package index there; python3 has a CUDA torch but no hivemind or
# bitsandbytes), one device call does it all, after `scripts/gpu_check.sh --fetch-wheels .whl` here
# (and `/.whl/` in .git/info/exclude): run `bash scripts/gpu_check.sh --wheels .whl --out $OUT` with
# carry [".whl"], then copy the files from $OUT into docs/results/gpu/ (docs/gpu.md).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

MODE=cuda
OUT=""
WHEELS=""
FETCH=""
SKIP_TESTS=0
SKIP_FIGURES=0
SKIP_RUN=0
RUN_SECONDS=""
FIGURES_BUDGET=""
usage() { sed -n '2,24p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
while (($#)); do
    case "$1" in
        --cpu) MODE=cpu ;;
        --out) OUT="$2"; shift ;;
        --wheels) WHEELS="$2"; shift ;;
        --fetch-wheels) FETCH="$2"; shift ;;
        --skip-tests) SKIP_TESTS=1 ;;
        --skip-figures) SKIP_FIGURES=1 ;;
        --skip-run) SKIP_RUN=1 ;;
        --run-seconds) RUN_SECONDS="$2"; shift ;;
        --figures-budget) FIGURES_BUDGET="$2"; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

say() { echo "[gpu_check] $*"; }
die() { echo "[gpu_check] ERROR: $*" >&2; exit 1; }

if [[ -n "$FETCH" ]]; then
    source "$ROOT/scripts/_venv.sh" test
    PYTHONPATH="$ROOT" "$VENV/bin/python" -m tests.gpu.check wheels --out "$FETCH" || exit 1
    say "carry $FETCH to the GPU machine and run: bash scripts/gpu_check.sh --wheels $FETCH --out DIR"
    exit 0
fi

if [[ "$MODE" == cpu ]]; then
    DEVICE=cpu
    OUT="${OUT:-$ROOT/out/gpu-check-cpu}"
    RUN_SECONDS="${RUN_SECONDS:-15}"
    FIGURES_BUDGET="${FIGURES_BUDGET:-60}"
    FIGURE_STEPS=(--steps 2 --warmup 1)
else
    DEVICE=cuda
    OUT="${OUT:-$ROOT/docs/results/gpu}"
    RUN_SECONDS="${RUN_SECONDS:-60}"
    FIGURES_BUDGET="${FIGURES_BUDGET:-200}"
    FIGURE_STEPS=(--steps 5 --warmup 2)
fi
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")"
exec > >(tee "$OUT/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1
STARTED=$SECONDS
say "mode $MODE, out $OUT, started $(date -u +%Y-%m-%dT%H:%M:%SZ)"

# ---- 1. a Python whose torch sees the device ---------------------------------------------------------
has_cuda_torch() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }
PY=""
say "step 1/7: a Python with torch for --device $DEVICE"
if [[ -n "${PYTHON:-}" ]]; then
    PY="$PYTHON"
elif [[ "$MODE" == cpu ]]; then
    source "$ROOT/scripts/_venv.sh" test
    PY="$VENV/bin/python"
else
    GPU_VENV="${P2P_DILOCO_GPU_VENV:-$HOME/.cache/p2p_diloco/gpu-venv}"
    for candidate in "$ROOT/.venv/bin/python" "$GPU_VENV/bin/python" python3 python; do
        if command -v "$candidate" >/dev/null 2>&1 && has_cuda_torch "$candidate"; then
            PY="$(command -v "$candidate")"
            break
        fi
    done
    if [[ -z "$PY" ]]; then
        command -v nvidia-smi >/dev/null 2>&1 \
            || die "no NVIDIA GPU here (no nvidia-smi) and no Python whose torch sees CUDA: use --cpu for the dry run"
        say "no importable CUDA torch (tried .venv, $GPU_VENV, python3): installing one into $GPU_VENV with pip"
        BASE_PY="$(command -v python3.11 || command -v python3)"
        { [[ -x "$GPU_VENV/bin/python" ]] || "$BASE_PY" -m venv "$GPU_VENV"; } \
            && "$GPU_VENV/bin/pip" install -q --disable-pip-version-check "torch==${P2P_DILOCO_TORCH:-2.13.0}" \
            && "$GPU_VENV/bin/pip" install -q --disable-pip-version-check -e "$ROOT[test]" \
            || die "no importable CUDA torch, and pip could not install one (no package index reachable?). Use a Python that has a CUDA build of torch: PYTHON=/path/to/python $0"
        has_cuda_torch "$GPU_VENV/bin/python" \
            || die "installed torch in $GPU_VENV but torch.cuda.is_available() is False (driver too old for this CUDA build?); nvidia-smi says: $(nvidia-smi -L 2>&1 | head -3)"
        PY="$GPU_VENV/bin/python"
    fi
fi
say "python: $PY ($("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "CUDA", torch.version.cuda)' 2>&1))"

# ---- 2. the project's dependencies --------------------------------------------------------------------
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
IMPORTS="import hivemind, bitsandbytes, multiaddr, blake3, safetensors, transformers, tokenizers, pytest, p2p_diloco.cli"
missing_imports() { "$PY" -c "$IMPORTS" 2>&1 | tail -1; }
say "step 2/7: dependencies"
if ! "$PY" -c "$IMPORTS" >/dev/null 2>&1; then
    say "missing: $(missing_imports)"
    if [[ -z "$WHEELS" && -d "$ROOT/.whl" ]]; then WHEELS="$ROOT/.whl"; fi
    if [[ -n "$WHEELS" ]]; then
        SITE="$WORK/site"
        say "installing $(ls "$WHEELS"/*.whl 2>/dev/null | wc -l) wheels from $WHEELS into $SITE (no index)"
        "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target "$SITE" "$WHEELS"/*.whl || die "pip could not install the wheels of $WHEELS"
        export PYTHONPATH="$SITE:$PYTHONPATH"
    else
        say "no --wheels folder: trying pip install -e .[test] from the package index"
        "$PY" -m pip install -q --disable-pip-version-check -e "$ROOT[test]" \
            || die "dependencies missing and no package index: on a machine without one, run scripts/gpu_check.sh --fetch-wheels .whl where pip works and carry .whl (docs/gpu.md)"
    fi
    "$PY" -c "$IMPORTS" >/dev/null 2>&1 || die "still missing after the install: $(missing_imports)"
fi
if [[ "$MODE" == cuda ]] && ! "$PY" -c 'from p2p_diloco.protocol import fused; import sys; sys.exit(0 if fused.active() else 1)' 2>/dev/null; then
    say "building the fused C kernels in place (optional: the torch fallback gives the same bits)"
    timeout 120 "$PY" setup.py -q build_ext --inplace >"$WORK/build_ext.log" 2>&1 || say "build failed: torch fallback"
fi

PHASES="{"
phase_done() { local took=$((SECONDS - $2)); PHASES+="$([[ "$PHASES" == "{" ]] || echo ,)\"$1\": $took"; }

# ---- 3. environment -------------------------------------------------------------------------------------
say "step 3/7: environment"
T=$SECONDS
"$PY" -m tests.gpu.check env --out "$OUT" --device "$DEVICE" || say "env failed"
phase_done env $T

# ---- 4. tests/gpu ----------------------------------------------------------------------------------------
if ((SKIP_TESTS)); then
    say "step 4/7: tests/gpu skipped (--skip-tests)"
else
    say "step 4/7: pytest tests/gpu -m gpu (without CUDA every test skips with the reason)"
    T=$SECONDS
    timeout 360 "$PY" -m pytest -q -p no:cacheprovider -rs -s tests/gpu -m gpu --timeout 300 \
        --junitxml="$WORK/tests.xml" 2>&1 | tee "$OUT/tests.log"
    say "tests/gpu: pytest exit $? after $((SECONDS - T)) s"
    phase_done tests $T
fi

# ---- 5. figures ------------------------------------------------------------------------------------------
if ((SKIP_FIGURES)); then
    say "step 5/7: figures skipped (--skip-figures)"
else
    say "step 5/7: figures (budget ${FIGURES_BUDGET} s; sizes past it are skipped)"
    T=$SECONDS
    timeout $((FIGURES_BUDGET + 240)) "$PY" -m tests.gpu.check figures --out "$OUT" --device "$DEVICE" \
        --budget "$FIGURES_BUDGET" "${FIGURE_STEPS[@]}" || say "figures: some setting failed (see figures.json)"
    phase_done figures $T
fi

# ---- 6. a short real run -------------------------------------------------------------------------------
if ((SKIP_RUN)); then
    say "step 6/7: real run skipped (--skip-run)"
else
    say "step 6/7: real run: a bootstrap and 2 joins ($DEVICE + cpu), ${RUN_SECONDS} s of training"
    T=$SECONDS
    timeout $((RUN_SECONDS + 300)) "$PY" -m tests.gpu.check realrun --out "$OUT" --device "$DEVICE" \
        --seconds "$RUN_SECONDS" || say "real run: failed (see realrun.json)"
    phase_done realrun $T
fi

# ---- 7. summary ------------------------------------------------------------------------------------------
PHASES+="}"
say "step 7/7: summary (phases: $PHASES, total $((SECONDS - STARTED)) s)"
"$PY" -m tests.gpu.check summary --out "$OUT" --junit "$WORK/tests.xml" --phases "$PHASES"
STATUS=$?
rm -rf "$WORK"
say "done in $((SECONDS - STARTED)) s: exit $STATUS; results in $OUT"
exit $STATUS
