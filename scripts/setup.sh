#!/usr/bin/env bash
# Create .venv with hftk, its dependencies, the test tools and the site builder. Idempotent: reruns take seconds.
# torch is the same version everywhere (TORCH_VERSION, inside pyproject.toml's range): its CPU
# build (+cpu) where nvidia-smi lists no GPU -- never a multi-GB CUDA wheel there -- and the
# default (CUDA) build where it lists one; then torch must see that GPU. An existing .venv goes
# through the same choice and the same check. pip's errors stop the script.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# pip's own exit status decides; only its "Location ... is ignored" notes about absent extra indexes are dropped.
pip_install() { .venv/bin/pip install --quiet --disable-pip-version-check "$@" 2> >(grep -v "is ignored" >&2); }

gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
installed=$(.venv/bin/python -c "import torch; print(torch.__version__)" 2>/dev/null || true)
if [ "${installed%%+*}" != "$TORCH_VERSION" ]; then
  if [ "$gpus" -gt 0 ]; then
    pip_install "torch==$TORCH_VERSION"
  else
    pip_install "torch==$TORCH_VERSION+cpu" || {
      echo "setup: torch $TORCH_VERSION+cpu not found; add PyTorch's CPU wheel index (pip --extra-index-url" \
           "or PIP_EXTRA_INDEX_URL) and rerun" >&2; exit 1; }
  fi
fi
if [ "$gpus" -gt 0 ]; then
  .venv/bin/python - "$gpus" <<'PY' || exit 1
import sys
import torch
listed = int(sys.argv[1])
if not torch.cuda.is_available():
    sys.exit(f"setup: nvidia-smi lists {listed} GPU(s) but torch {torch.__version__} sees none (a CPU wheel on a GPU "
             f"machine, or a driver older than CUDA {torch.version.cuda}): reinstall with `.venv/bin/pip install "
             f"--force-reinstall torch=={torch.__version__.split('+')[0]}` or update the driver")
print(f"setup: torch {torch.__version__} (CUDA {torch.version.cuda}) sees {torch.cuda.device_count()} of {listed} GPU(s): "
      f"{torch.cuda.get_device_name(0)}")
PY
fi
pip_install -e ".[dev,docs]"  # docs: the suite builds the site (tests/integration/test_docs.py)
.venv/bin/python -c "import hftk, torch, transformers, deepspeed" >/dev/null \
  || { echo "setup failed: hftk or a dependency does not import" >&2; exit 1; }
