"""Operations for scaled graphs: dynamic rescaling, low-precision casts, stats.

Each operation is a ``custom_jvp`` *marker*: called on plain arrays (outside
``scalify``, or inside it on a tensor that is not scaled) it is what its
docstring says in plain JAX (``dynamic_rescale_*`` is the identity); inside
``scalify`` on a ScaledArray it runs its scaled rule. With ``grad=True``
an operation is the identity in the forward pass and applies to the
gradient in the backward pass.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qbits._errors import InvalidArgumentError, check_bool
from qbits._formats import float_format, round_to_format
from qbits.scaled._array import ScaledArray
from qbits.scaled._rules import F32, choose_scale, finish, scale32
from qbits.scaled._structure import register_marker


def _marker(
    name: str, plain: Callable[[jax.Array], jax.Array], scaled: Callable[..., Any]
):
    """A custom_jvp function named ``name``: ``plain`` in JAX, ``scaled`` in scalify.

    The tangent passes straight through. The primal output is computed by
    calling the function itself so that the marker survives ``jax.grad``.
    """

    def fn(x: jax.Array) -> jax.Array:
        return plain(x)

    fn.__name__ = fn.__qualname__ = name
    marker = jax.custom_jvp(fn)

    @marker.defjvp
    def _jvp(primals: tuple[jax.Array], tangents: tuple[jax.Array]) -> Any:
        return marker(primals[0]), tangents[0]

    register_marker(name, scaled)
    marker.scaled_rule = scaled  # for ScaledArrays given outside scalify
    return marker


def _on_grad(
    forward: Callable[[jax.Array], jax.Array],
) -> Callable[[jax.Array], jax.Array]:
    """Identity whose backward pass applies ``forward`` to the cotangent."""

    @jax.custom_vjp
    def fn(x: jax.Array) -> jax.Array:
        return x

    fn.defvjp(lambda x: (x, None), lambda _, g: (forward(g),))
    return fn


def _rescale(x: ScaledArray, statistic: jax.Array) -> ScaledArray:
    """Moves ``statistic`` (of the data) into the scale."""
    s_in = scale32(x)
    ok = jnp.isfinite(statistic) & (statistic > 0)
    s = choose_scale(jnp.where(ok, s_in * statistic, s_in), [x])
    data = jnp.asarray(x.data, F32) * (s_in / s)
    return finish(data.astype(x.dtype), s, [x])


def _rescale_max(x: ScaledArray) -> ScaledArray:
    return _rescale(x, jnp.max(jnp.abs(jnp.asarray(x.data, F32))))


def _rescale_l2(x: ScaledArray) -> ScaledArray:
    return _rescale(x, jnp.sqrt(jnp.mean(jnp.square(jnp.asarray(x.data, F32)))))


_max = _marker("qbits_dynamic_rescale_max", lambda x: x, _rescale_max)
_l2 = _marker("qbits_dynamic_rescale_l2", lambda x: x, _rescale_l2)


def _tree(fn: Callable[[jax.Array], jax.Array], tree: Any) -> Any:
    def apply(x: Any) -> Any:
        if isinstance(x, ScaledArray):  # outside scalify: call the scaled rule
            return fn.scaled_rule(x)
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
            return fn(x)
        return x

    return jax.tree.map(apply, tree, is_leaf=lambda v: isinstance(v, ScaledArray))


def dynamic_rescale_max(tree: Any, *, grad: bool = False) -> Any:
    """Rescales so that the data's largest magnitude is about 1.

    The scale absorbs ``max(|data|)`` (rounded like every scalify scale); the
    represented value does not change. On plain arrays: the identity.

    Args:
      tree: An array, a ScaledArray or a pytree of them (e.g. model state).
      grad: Rescale the gradient instead: the identity in the forward pass,
        the rescaling of ``tree``'s gradient (``tree`` an array) in the
        backward pass.

    Returns:
      The same structure, rescaled.

    Example:
      >>> import numpy as np
      >>> from qbits import scaled
      >>> x = scaled.as_scaled_array(np.array([0.01, -0.03], np.float32))
      >>> scaled.dynamic_rescale_max(x)
      ScaledArray(data=Array([ 0.32, -0.96], dtype=float32), scale=0.03125)

      On the gradient (outside scalify the plain gradient):

      >>> f = lambda x: (scaled.dynamic_rescale_max(x, grad=True) * 2).sum()
      >>> jax.grad(f)(jnp.ones(3))
      Array([2., 2., 2.], dtype=float32)
    """
    return _rescaled("dynamic_rescale_max", _max, _max_grad, tree, grad)


def dynamic_rescale_l2(tree: Any, *, grad: bool = False) -> Any:
    """Rescales so that the data's root mean square is about 1.

    As :func:`dynamic_rescale_max` (``grad`` too), with the root mean square
    of the data. Leaves that are not float arrays stay as they are.

    Example:
      >>> import numpy as np
      >>> from qbits import scaled
      >>> w = scaled.as_scaled_array(np.array([0.5, -1.5, 2.0], np.float32))
      >>> scaled.dynamic_rescale_l2({"w": w, "step": 3})
      {'step': 3,
       'w': ScaledArray(data=Array([ 0.25, -0.75,  1.  ], dtype=float32), scale=2.0)}
    """
    return _rescaled("dynamic_rescale_l2", _l2, _l2_grad, tree, grad)


_max_grad = _on_grad(_max)
_l2_grad = _on_grad(_l2)


def _rescaled(
    owner: str,
    marker: Callable[..., Any],
    on_grad: Callable[..., Any],
    tree: Any,
    grad: bool,
) -> Any:
    check_bool(owner, "grad", grad)
    return on_grad(tree) if grad else _tree(marker, tree)


def _saturating_round(x: jax.Array, dtype: Any) -> jax.Array:
    fmt = float_format(dtype, owner="cast_ml_dtype")
    x32 = jnp.asarray(x, F32)
    return round_to_format(jnp.clip(x32, -fmt.max, fmt.max), fmt).astype(x.dtype)


@functools.cache
def _cast_marker(dtype_name: str) -> Callable[[jax.Array], jax.Array]:
    def scaled(x: ScaledArray) -> ScaledArray:
        return ScaledArray(_saturating_round(x.data, dtype_name), x.scale)

    return _marker(
        f"qbits_cast_ml_dtype[{dtype_name}]",
        lambda x: _saturating_round(x, dtype_name),
        scaled,
    )


def _dtype_name(dtype: Any) -> str:
    return float_format(dtype, owner="cast_ml_dtype").dtype.name


def cast_ml_dtype(x: Any, dtype: Any, *, grad: bool = False) -> Any:
    """Rounds onto a low-precision float format, keeping the storage dtype.

    Simulates storing in ``dtype`` (any ml_dtypes float of 8 bits or fewer:
    ``float8_e4m3fn``, ``float8_e5m2``, fp6, fp4): values saturate at the
    format's largest value, then round to nearest even, subnormals included.
    On a ScaledArray inside ``scalify`` the *data* is rounded: the scale
    carries the magnitude, so nothing saturates that the data represents
    well. The gradient passes straight through.

    Args:
      x: An array or a ScaledArray.
      dtype: The format.
      grad: Round the gradient instead (e.g. onto E5M2): the identity in the
        forward pass, ``x``'s gradient rounded in the backward pass (``x``
        an array).

    Returns:
      ``x`` rounded, in its own dtype.

    Raises:
      InvalidArgumentError: For a dtype that is not such a format.

    Example:
      >>> import jax.numpy as jnp
      >>> from qbits.scaled import cast_ml_dtype
      >>> cast_ml_dtype(jnp.array([0.3, 500.0]), jnp.float8_e4m3fn).tolist()
      [0.3125, 448.0]
      >>> f = lambda x: (cast_ml_dtype(x, "float8_e5m2", grad=True) * 0.3).sum()
      >>> jax.grad(f)(jnp.ones(3))  # 0.3 on the E5M2 grid
      Array([0.3125, 0.3125, 0.3125], dtype=float32)
    """
    check_bool("cast_ml_dtype", "grad", grad)
    name = _dtype_name(dtype)
    if grad:
        return _cast_grad(name)(x)
    marker = _cast_marker(name)
    return marker.scaled_rule(x) if isinstance(x, ScaledArray) else marker(x)


@functools.cache
def _cast_grad(dtype_name: str) -> Callable[[jax.Array], jax.Array]:
    return _on_grad(_cast_marker(dtype_name))


def wasted_bits(x: Any, dtype: Any = None) -> jax.Array:
    """How many bits of a dtype's range a tensor leaves unused at the top.

    ``log2(range / max|x|)``, where ``range`` is the dtype's largest value
    (floats) or ``2**(bits - 1)`` (signed integers): the number of times the
    tensor could be doubled before it overflows. For int8 data
    ``[1, 2, -16]`` that is 3; all-zero data wastes all the dtype's bits.
    For a ScaledArray, the data is measured.

    Args:
      x: An array or a ScaledArray.
      dtype: The dtype whose range is measured; defaults to the data's.

    Returns:
      A float32 scalar.

    Example:
      >>> import numpy as np
      >>> from qbits.scaled import wasted_bits
      >>> float(wasted_bits(np.array([1, 2, -16], np.int8)))
      3.0
    """
    data = x.data if isinstance(x, ScaledArray) else x
    data = jnp.asarray(data)
    dtype = np.dtype(data.dtype if dtype is None else dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        top = float(jnp.finfo(dtype).max)
    elif jnp.issubdtype(dtype, jnp.signedinteger):
        top = float(2 ** (jnp.iinfo(dtype).bits - 1))
    else:
        raise InvalidArgumentError(
            "wasted_bits", "dtype", dtype, "a float or signed int dtype"
        )
    absmax = jnp.max(jnp.abs(data.astype(F32)))
    bits = np.float32(dtype.itemsize * 8)
    return jnp.where(absmax > 0, np.float32(np.log2(top)) - jnp.log2(absmax), bits)
