#!/usr/bin/env bash
# The GPU smoke run on a fresh GPU machine (docs/gpu.md): install the GPU stack into its own venv, then run
# tools/gpu_smoke.py (PASS / FAIL per check, a JSON summary, exit status 1 when a check fails).
#
#   bash tools/gpu_smoke.sh                   # installs vllm==0.33.0 (with its torch) + the project, runs the checks
#   bash tools/gpu_smoke.sh --with-te         # also Transformer Engine (compiles its torch extension: slow)
#   bash tools/gpu_smoke.sh --dry             # no install: every check on the CPU through stand-ins, in .venv (CI)
#   VENV=/tmp/gpu bash tools/gpu_smoke.sh --only vllm_parity --json smoke.json
#
# Only the package registry is needed. Other arguments go to tools/gpu_smoke.py. PYTHON: with --dry the
# interpreter that runs the checks (default .venv/bin/python), otherwise the one that creates the venv.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DRY=0
TE=0
for arg in "$@"; do
  case "$arg" in
    --dry) DRY=1 ;;
    --with-te) TE=1 ;;
  esac
done

if [ "$DRY" = 1 ]; then
  PY="${PYTHON:-$ROOT/.venv/bin/python}"
else
  VENV="${VENV:-$ROOT/.venv-gpu}"
  VLLM_VERSION="${VLLM_VERSION:-0.33.0}"
  test -x "$VENV/bin/python" || "${PYTHON:-python3}" -m venv "$VENV"
  PIP=("$VENV/bin/python" -m pip install -q --no-input)
  "${PIP[@]}" --upgrade pip
  "${PIP[@]}" "vllm==$VLLM_VERSION"          # pins its torch (2.14.0, CUDA 13.0 wheels) and transformers
  "${PIP[@]}" -e "$ROOT[dev]"               # torch>=2.4 is met: nothing of vLLM's is replaced
  if [ "$TE" = 1 ]; then                    # compiled against the installed torch: needs nvcc and cuDNN headers
    CUDA_MAJOR="$("$VENV/bin/python" -c 'import torch; print(torch.version.cuda.split(".")[0])')"
    "${PIP[@]}" --no-build-isolation "transformer-engine[pytorch,core-cu${CUDA_MAJOR}]>=2.9"
  fi
  PY="$VENV/bin/python"
fi
exec "$PY" "$ROOT/tools/gpu_smoke.py" "$@"
