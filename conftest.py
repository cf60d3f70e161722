"""Shared pytest setup for the tests and the docstring examples.

Strict dtype promotion is on everywhere, so a silent promotion (the way a
quantized path quietly becomes float) is an error. Hypothesis runs a fixed,
derandomized set of 10 examples a test in CI (simplest first); set
``HYPOTHESIS_PROFILE=dev`` for more.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import settings

import qbits

# Scripts that are run, not imported: one needs aqtp, the other sets XLA_FLAGS
# for a subprocess with 8 devices.
collect_ignore = [
    "tests/data/make_aqt_golden.py",
    "tests/ops/sharded_check.py",
    "tests/ops/shard_map_check.py",
]

settings.register_profile("ci", max_examples=10, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=300, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _strict_dtype_promotion():
    with jax.numpy_dtype_promotion("strict"):
        yield


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace):
    doctest_namespace.update(qbits=qbits, jax=jax, jnp=jnp, np=np)
