#!/usr/bin/env bash
# The test suite with the newest jax, jaxlib and flax on PyPI (they need
# Python 3.12+). CI (.ci/run, Python 3.11) tests the oldest supported end of
# the range, jax 0.10; run this by hand for the newest end:
#   PYTHON=python3.13 tests/newest_jax.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-python3.12}" -m venv .venv-newest
.venv-newest/bin/pip install -q --upgrade -e '.[test]' 'jax<0.13' 'flax<0.13'
.venv-newest/bin/python -c 'import jax, flax; print("jax", jax.__version__, "flax", flax.__version__)'
.venv-newest/bin/python -m pytest "$@"
