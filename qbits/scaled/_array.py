"""ScaledArray: a low-precision ``data`` tensor times a scalar ``scale``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from qbits._errors import InvalidArgumentError

__all__ = ["ScaledArray", "as_scaled_array", "asarray", "is_scaled", "pow2_split"]

E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
_SCALE_DTYPES = (np.dtype(np.float32), E8M0)


@jax.tree_util.register_pytree_node_class
class ScaledArray:
    """A tensor represented as ``data * scale``.

    ``data`` holds the values in a low-precision float dtype (float16,
    bfloat16, any ml_dtypes fp8, or float32); ``scale`` is a positive scalar
    in float32 or E8M0 (``float8_e8m0fnu``). The represented value is their
    product; the scale carries the magnitude so that ``data`` stays in the
    range its dtype represents well. A ScaledArray is a pytree with the two
    arrays as children, so it passes through ``jit``, ``vmap`` and optax.

    Attributes:
      data: The scaled values, any float dtype.
      scale: A positive scalar, float32 or E8M0.

    Raises:
      InvalidArgumentError: If ``data`` is not a float array or ``scale`` is
        not a scalar of an allowed dtype.

    Example:
      >>> import numpy as np
      >>> from qbits.scaled import ScaledArray
      >>> x = ScaledArray(np.array([1.0, 2.0], np.float16), np.float32(4))
      >>> x
      ScaledArray(data=array([1., 2.], dtype=float16), scale=4.0)
      >>> np.asarray(x)
      array([4., 8.], dtype=float16)
    """

    __slots__ = ("data", "scale")

    def __init__(self, data: Any, scale: Any):
        if scale is None or isinstance(data, int):  # an axis spec, e.g. in_axes
            self.data, self.scale = data, scale
            return
        if hasattr(data, "dtype") and not jnp.issubdtype(data.dtype, jnp.floating):
            raise InvalidArgumentError(
                "ScaledArray", "data", data.dtype, "an array of a float dtype"
            )
        scale_shape = np.shape(scale)
        if scale_shape != ():
            raise InvalidArgumentError(
                "ScaledArray", "scale", f"an array of shape {scale_shape}", "a scalar"
            )
        if hasattr(scale, "dtype") and np.dtype(scale.dtype) not in _SCALE_DTYPES:
            raise InvalidArgumentError(
                "ScaledArray",
                "scale",
                scale.dtype,
                "a float32 or float8_e8m0fnu scalar",
            )
        if not hasattr(scale, "dtype"):
            scale = np.float32(scale)
        self.data = data
        self.scale = scale

    def tree_flatten(self) -> tuple[tuple[Any, Any], None]:
        """Children ``(data, scale)``, no static data."""
        return (self.data, self.scale), None

    @classmethod
    def tree_unflatten(cls, aux: None, children: tuple[Any, Any]) -> ScaledArray:
        """Rebuilds from children, without validation."""
        # Transformations unflatten with tracers, sentinels or None: no checks.
        obj = object.__new__(cls)
        obj.data, obj.scale = children
        return obj

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of ``data`` (and of the value)."""
        return tuple(self.data.shape)

    @property
    def dtype(self) -> np.dtype:
        """The dtype of ``data`` (and of the value it represents)."""
        return np.dtype(self.data.dtype)

    @property
    def ndim(self) -> int:
        """The number of dimensions."""
        return len(self.data.shape)

    @property
    def size(self) -> int:
        """The number of elements."""
        return int(np.prod(self.data.shape))

    def to_array(self, dtype: Any = None) -> jax.Array:
        """The represented value ``data * scale``, computed in float32.

        Args:
          dtype: The result dtype; defaults to the dtype of ``data``.
        """
        dtype = self.dtype if dtype is None else np.dtype(dtype)
        compute = dtype if dtype.itemsize > 4 else np.dtype(np.float32)
        value = jnp.asarray(self.data, compute) * jnp.asarray(self.scale, compute)
        return value.astype(dtype)

    def astype(self, dtype: Any) -> ScaledArray:
        """The same scale with ``data`` cast to ``dtype`` (a float dtype).

        Values outside the range of ``dtype`` follow its overflow (inf for
        float16, NaN for ``float8_e4m3fn``): choose the scale first, e.g. with
        :func:`qbits.scaled.dynamic_rescale_max`.
        """
        if not jnp.issubdtype(dtype, jnp.floating):
            raise InvalidArgumentError(
                "ScaledArray.astype", "dtype", np.dtype(dtype), "a float dtype"
            )
        return ScaledArray(jnp.asarray(self.data).astype(dtype), self.scale)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        data = np.asarray(self.data)
        value = data.astype(np.float32) * np.asarray(self.scale, np.float32)
        return value.astype(data.dtype if dtype is None else dtype)

    def __repr__(self) -> str:
        scale = self.scale
        if isinstance(scale, (np.ndarray, np.generic, jax.Array)) and not isinstance(
            scale, jax.core.Tracer
        ):
            scale = float(np.asarray(scale, np.float32))
        return f"ScaledArray(data={self.data!r}, scale={scale!r})"


def is_scaled(x: Any) -> bool:
    """Whether ``x`` is a :class:`ScaledArray` (use as ``is_leaf=``).

    Example:
      >>> from qbits import scaled
      >>> x = scaled.as_scaled_array(jnp.ones(2))
      >>> scaled.is_scaled(x), scaled.is_scaled(jnp.ones(2))
      (True, False)
    """
    return isinstance(x, ScaledArray)


def pow2_split(value: Any) -> tuple[np.ndarray, np.float32]:
    """Splits a concrete scalar into ``(mantissa, power_of_two)``.

    ``value == mantissa * power_of_two`` exactly, ``|mantissa|`` in
    ``[1, 2)`` (0 for zero, with ``power_of_two = 1``), the power of two
    positive. Used to turn constants into scaled form without rounding.
    """
    v = np.float32(value)
    if v == 0 or not np.isfinite(v):
        return np.float32(v), np.float32(1)
    mantissa, exponent = np.frexp(v)  # v = m * 2**e, |m| in [0.5, 1)
    return np.float32(mantissa * 2), np.float32(np.ldexp(np.float32(1), exponent - 1))


def _scale_array(scale: Any, scale_dtype: Any) -> jax.Array:
    dtype = np.dtype(scale_dtype)
    if dtype not in _SCALE_DTYPES:
        raise InvalidArgumentError(
            "as_scaled_array", "scale_dtype", dtype, "float32 or float8_e8m0fnu"
        )
    return jnp.asarray(scale, jnp.float32).astype(dtype)


def as_scaled_array(
    tree: Any, scale: Any = None, *, scale_dtype: Any = np.float32
) -> Any:
    """Represents every float array of a pytree as a :class:`ScaledArray`.

    The represented values do not change: ``data = x / scale``. Integer and
    boolean leaves (step counters, labels) and existing ScaledArrays are left
    as they are.

    Args:
      tree: An array, a Python scalar, or a pytree of them.
      scale: The scale to use. ``None``: 1 for arrays; for scalars the power
        of two that brings the mantissa into ``[1, 2)``.
      scale_dtype: float32 (default) or ``float8_e8m0fnu``; an E8M0 scale
        must be a power of two.

    Returns:
      The same structure with ScaledArrays in place of float arrays.

    Example:
      >>> import numpy as np
      >>> from qbits.scaled import as_scaled_array
      >>> as_scaled_array(np.array([1.0, 2.0], np.float16), scale=np.float32(0.5))
      ScaledArray(data=array([2., 4.], dtype=float16), scale=0.5)
    """

    def convert(x: Any) -> Any:
        if isinstance(x, ScaledArray):
            return x
        if not hasattr(x, "dtype"):
            if not isinstance(x, float):
                return x
            x = np.float32(x)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        if scale is None and np.ndim(x) == 0 and not isinstance(x, jax.core.Tracer):
            mantissa, power = pow2_split(x)
            return ScaledArray(
                mantissa.astype(x.dtype), _scale_array(power, scale_dtype)
            )
        s = _scale_array(1.0 if scale is None else scale, scale_dtype)
        if scale is None:
            return ScaledArray(x, s)
        is_numpy = isinstance(x, (np.ndarray, np.generic))
        data = (
            (np.asarray(x, np.float32) / np.float32(s.astype(np.float32)))
            if is_numpy
            else (jnp.asarray(x, jnp.float32) / s.astype(jnp.float32))
        )
        return ScaledArray(data.astype(x.dtype), s)

    return jax.tree.map(convert, tree, is_leaf=is_scaled)


def asarray(tree: Any, dtype: Any = None) -> Any:
    """Replaces every :class:`ScaledArray` in a pytree by its value.

    Args:
      tree: A ScaledArray, an array, or a pytree of them.
      dtype: The dtype of the values; defaults to each ``data``'s dtype.
        Plain arrays are cast to it when given.

    Returns:
      The same structure with plain arrays.

    Example:
      >>> import numpy as np
      >>> from qbits.scaled import ScaledArray, asarray
      >>> asarray({"w": ScaledArray(np.array([1.5], np.float32), np.float32(4))})
      {'w': Array([6.], dtype=float32)}
    """

    def convert(x: Any) -> Any:
        if isinstance(x, ScaledArray):
            return x.to_array(dtype)
        return x if dtype is None else jnp.asarray(x, dtype)

    return jax.tree.map(convert, tree, is_leaf=is_scaled)
