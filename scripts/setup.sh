#!/usr/bin/env bash
# Create .venv with hftk, its dependencies and the test tools.
# torch: a CPU build on machines without an NVIDIA GPU (never a multi-GB CUDA wheel there),
# the default CUDA build where `nvidia-smi -L` lists a GPU. Idempotent: reruns take seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip_install() { .venv/bin/pip install --quiet --disable-pip-version-check "$@" 2>&1 | grep -v "is ignored" || true; }
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip_install "torch>=2.6"
  else
    pip_install "torch==2.13.0"
  fi
fi
pip_install -e ".[dev]"
.venv/bin/python -c "import hftk, torch, transformers, deepspeed" >/dev/null 2>&1 \
  || { echo "setup failed: hftk or a dependency does not import" >&2; exit 1; }
