#!/usr/bin/env bash
# Installs XLA's GPU compiler (the CUDA plugin, about 3 GB) and libtpu in a
# virtual environment of their own (.venv-gpu, Python 3.12) and runs the
# tests that compile qbits' steps for an H100 and a TPU v5e without either
# (tests/hlo/test_gpu_program.py; skipped in the main suite).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3.12}
[ -x .venv-gpu/bin/python ] || "$python" -m venv .venv-gpu
.venv-gpu/bin/pip install -q -e '.[test,gpu,tpu]'
JAX_PLATFORMS=cpu,cuda CUDA_VISIBLE_DEVICES=-1 JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 \
  .venv-gpu/bin/python -m pytest -p no:cacheprovider -n 2 tests/hlo "$@"
