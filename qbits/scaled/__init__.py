"""Scaled arithmetic: :class:`ScaledArray` and end-to-end scale propagation.

A :class:`ScaledArray` represents ``data * scale``: the data in a low
precision float (float16, bfloat16, fp8), the magnitude in a scalar scale
(float32 or E8M0). :func:`scalify` runs a whole function (forward, backward
and optimizer update) on ScaledArrays with unit-scaling rules, so that a
float16 or fp8 graph neither overflows nor underflows where its float32
original would not. :func:`dynamic_rescale_max` / :func:`dynamic_rescale_l2`
re-center a tensor's scale on its data, :func:`cast_ml_dtype` simulates an
fp8 (or fp6/fp4) cast, :func:`wasted_bits` measures unused range.

The idea follows Graphcore's jax-scalify (Balança et al., "Scalify: scale
propagation for efficient low-precision LLM training", 2024), rebuilt on the
current JAX jaxpr API.

Example:
  >>> import jax, numpy as np
  >>> from qbits import scaled
  >>> a = np.random.default_rng(0).normal(size=(16, 1024)).astype(np.float32) * 128
  >>> b = np.random.default_rng(1).normal(size=(1024, 8)).astype(np.float32) * 64
  >>> sa = scaled.as_scaled_array(a, np.float32(128)).astype(np.float16)
  >>> sb = scaled.as_scaled_array(b, np.float32(64)).astype(np.float16)
  >>> out = jax.jit(scaled.scalify(lambda x, y: x @ y))(sa, sb)
  >>> float(out.scale), bool(np.isfinite(np.asarray(out.data)).all())
  (262144.0, True)
"""

from qbits.scaled._array import ScaledArray, as_scaled_array, asarray, is_scaled
from qbits.scaled._interpreter import (
    UnsupportedPrimitiveError,
    register_rule,
    scalify,
)

# The rules register themselves when imported.
from qbits.scaled import _control, _rules, _structure  # noqa: F401  # isort: skip
from qbits.scaled._ops import (  # isort: skip
    cast_ml_dtype,
    dynamic_rescale_l2,
    dynamic_rescale_max,
    wasted_bits,
)

__all__ = [
    "ScaledArray",
    "UnsupportedPrimitiveError",
    "as_scaled_array",
    "asarray",
    "cast_ml_dtype",
    "dynamic_rescale_l2",
    "dynamic_rescale_max",
    "is_scaled",
    "register_rule",
    "scalify",
    "wasted_bits",
]
