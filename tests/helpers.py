"""Shared strategies and helpers for the tests."""

import functools
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))

shapes = hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=9)


@st.composite
def float_arrays(draw, shape=None, max_log10=3):
    """Random normal arrays of a drawn shape, magnitude and float dtype."""
    shape = draw(shapes) if shape is None else shape
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    seed = draw(st.integers(0, 2**32 - 1))
    log10 = draw(st.integers(-3, max_log10))
    x = np.random.default_rng(seed).standard_normal(shape) * 10.0**log10
    return jnp.asarray(x.astype(np.float32)).astype(dtype)


def half_ulp(x, dtype):
    """Half a unit in the last place of ``dtype`` at magnitude ``|x|``."""
    info = jnp.finfo(dtype)
    a = np.maximum(np.abs(np.asarray(x, np.float64)), float(info.tiny))
    return np.exp2(np.floor(np.log2(a)) - info.nmant - 1)


def bits_equal(a, b):
    """Exact equality of values, treating NaN as equal to NaN."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return bool(np.all((a == b) | (np.isnan(a) & np.isnan(b))))


@functools.partial(jax.jit, static_argnums=0, static_argnames="store")
def quant(quantizer, x, context=None, store=False):
    """``quantizer.quant`` compiled once per quantizer, shape and dtype."""
    return quantizer.quant(x, context, store=store)


@functools.partial(jax.jit, static_argnums=0)
def fake_quant(quantizer, x, context=None):
    """``quantizer.quant(x).dequant()``, compiled."""
    return quantizer.quant(x, context).dequant()


def run_script(path: pathlib.Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """Runs a check script in a fresh process on the qbits the tests import.

    (Run by path, a script would import whichever qbits is installed: in a
    second checkout or worktree, another one.) The scripts that need 8 CPU
    devices set ``XLA_FLAGS`` themselves before importing jax.
    """
    import qbits

    root = str(pathlib.Path(qbits.__file__).resolve().parents[1])
    given = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": root + (os.pathsep + given if given else "")}
    return subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True,
        timeout=timeout, env=env,
    )  # fmt: skip
