"""``scalify``: run a function's jaxpr on ScaledArrays, one rule per primitive.

The function is traced once to a jaxpr on the shapes and dtypes of the data;
then every equation runs on the actual values. An equation none of whose
inputs is a ScaledArray runs exactly as JAX would run it; one with a
ScaledArray input runs its primitive's *scaled rule*, which computes the new
data and scale (``rules.py``, ``structure.py``). Scalar constants (literals
and broadcasts of them) are tracked as :class:`Const` so that ``x * 0.1``
goes into the scale and ``max(x, 0)`` takes ``x``'s scale, without rounding.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from qbits._calibration import SCALE_ROUNDINGS
from qbits._errors import check_choice
from qbits._jaxpr import bind
from qbits.scaled._array import ScaledArray, is_scaled

__all__ = [
    "Const",
    "UnsupportedPrimitiveError",
    "current_rounding",
    "register_rule",
    "scalify",
]

Rule = Callable[..., Any]
_RULES: dict[str, Rule] = {}
_ROUNDING = contextvars.ContextVar("qbits_scaled_rounding", default="pow2")

# Shape-only primitives that carry a broadcast scalar constant along.
_CONST_PRESERVING = (
    "broadcast_in_dim",
    "convert_element_type",
    "reshape",
    "squeeze",
    "expand_dims",
    "transpose",
    "copy",
    "copy_p",
)


# Elementwise primitives folded when every operand is a Const: ``1 / n`` in a
# mean's gradient stays a constant that rules can fold into scales.
_FOLDABLE = frozenset(
    (
        "add", "sub", "mul", "div", "neg", "max", "min", "abs", "sqrt", "rsqrt",
        "exp", "log", "integer_pow", "square", "convert_element_type",
    )
)  # fmt: skip


# Host callbacks get the represented values of ScaledArrays.
_CALLBACKS = frozenset(
    ("debug_print", "debug_callback", "pure_callback", "io_callback")
)


class UnsupportedPrimitiveError(NotImplementedError):
    """``scalify`` met a primitive it has no scaled rule for.

    Attributes:
      primitive: The primitive's name, e.g. ``"fft"``.

    Example:
      >>> from qbits import scaled
      >>> x = scaled.as_scaled_array(jnp.ones(4), jnp.float32(2.0))
      >>> try:
      ...     scaled.scalify(jax.lax.igamma)(x, x)
      ... except scaled.UnsupportedPrimitiveError as e:
      ...     print(e.primitive)
      igamma
    """

    def __init__(self, primitive: str):
        self.primitive = primitive
        super().__init__(
            f"scalify: no scaled rule for the primitive '{primitive}' (it has a "
            "ScaledArray input). Convert that input with qbits.scaled.asarray "
            "before the operation, or add a rule with "
            "qbits.scaled.register_rule."
        )


class Const:
    """A float scalar constant, possibly broadcast: every element is ``value``.

    Rules fold it into the scale (``mul``, ``div``) or into the other
    operand's scale (``max``, ``select_n``, ``clamp``, ...).
    """

    __slots__ = ("dtype", "shape", "value")

    def __init__(self, value: Any, shape: tuple[int, ...], dtype: Any):
        self.value = np.float32(value)
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)

    def materialize(self) -> jax.Array:
        """The constant as an array of its shape and dtype."""
        return jnp.full(self.shape, self.value, self.dtype)


def register_rule(primitive: str, rule: Rule) -> None:
    """Registers the scaled rule of a primitive (by name).

    The rule is called as ``rule(*operands, **params)`` with the equation's
    params; operands are :class:`ScaledArray`, :class:`Const` or plain arrays
    (at least one ScaledArray). It returns the output (a list for
    multiple-result primitives).

    Example:
      >>> from qbits import scaled
      >>> def bessel_i1e(x, **params):  # bounded by 1/2: needs no scale
      ...     y = jax.lax.bessel_i1e(scaled.asarray(x))
      ...     return scaled.as_scaled_array(y, jnp.float32(1.0))
      >>> scaled.register_rule("bessel_i1e", bessel_i1e)
      >>> y = scaled.scalify(jax.lax.bessel_i1e)(
      ...     scaled.as_scaled_array(jnp.ones(2), jnp.float32(3.0)))
      >>> float(y.scale), bool(jnp.allclose(scaled.asarray(y), jax.lax.bessel_i1e(1.0)))
      (1.0, True)
    """
    _RULES[primitive] = rule


def current_rounding() -> str:
    """The scale rounding of the running ``scalify``: none, pow2 or e8m0."""
    return _ROUNDING.get()


@contextlib.contextmanager
def _rounding(mode: str) -> Iterator[None]:
    token = _ROUNDING.set(mode)
    try:
        yield
    finally:
        _ROUNDING.reset(token)


def _as_const(value: Any, aval: Any) -> Const | None:
    """A Const for a concrete float scalar, else None."""
    if isinstance(value, jax.core.Tracer) or np.shape(value) != ():
        return None
    dtype = getattr(aval, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        return None
    return Const(np.asarray(value, np.float32), (), dtype)


def plain(x: Any) -> Any:
    """A :class:`Const` as an array; anything else as it is."""
    return x.materialize() if isinstance(x, Const) else x


def eval_jaxpr(jaxpr: Any, consts: list[Any], *args: Any) -> list[Any]:
    """Evaluates a jaxpr on ScaledArrays, Consts and plain arrays."""
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        if isinstance(v, jcore.Literal):
            return _as_const(v.val, v.aval) or v.val
        return env[v]

    def write(v: Any, value: Any) -> None:
        if not isinstance(v, jcore.DropVar):
            env[v] = value

    for v, c in zip(jaxpr.constvars, consts, strict=True):
        write(v, _as_const(c, v.aval) or c)
    for v, a in zip(jaxpr.invars, args, strict=True):
        write(v, a)
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name in _CALLBACKS:  # jax.debug.print & co. see the values
            invals = [x.to_array() if isinstance(x, ScaledArray) else x for x in invals]
        if any(isinstance(x, ScaledArray) for x in invals):
            rule = _RULES.get(name)
            if rule is None:
                raise UnsupportedPrimitiveError(name)
            outvals = rule(*invals, **eqn.params)
        elif name in _FOLDABLE and invals and all(isinstance(x, Const) for x in invals):
            outvals = _fold(eqn, invals)
        elif name in _CONST_PRESERVING and isinstance(invals[0], Const):
            aval = eqn.outvars[0].aval
            if jnp.issubdtype(aval.dtype, jnp.floating):
                outvals = Const(invals[0].value, aval.shape, aval.dtype)
            else:
                outvals = bind(eqn, [plain(x) for x in invals])
        else:
            outvals = bind(eqn, [plain(x) for x in invals])
        if not eqn.primitive.multiple_results:
            outvals = [outvals]
        for v, val in zip(eqn.outvars, outvals, strict=True):
            write(v, val)
    return [read(v) for v in jaxpr.outvars]


def _fold(eqn: Any, consts: list[Const]) -> Any:
    """Evaluates an elementwise primitive on constants, at trace time."""
    aval = eqn.outvars[0].aval
    with jax.ensure_compile_time_eval():
        scalars = [jnp.asarray(c.value, c.dtype) for c in consts]
        out = np.asarray(bind(eqn, scalars))
    if not jnp.issubdtype(aval.dtype, jnp.floating):
        return jnp.full(aval.shape, out, aval.dtype)
    return Const(out, aval.shape, aval.dtype)


def eval_closed(closed: Any, *args: Any) -> list[Any]:
    """Evaluates a ClosedJaxpr (or an open Jaxpr without consts)."""
    if isinstance(closed, jcore.ClosedJaxpr):
        return eval_jaxpr(closed.jaxpr, closed.consts, *args)
    return eval_jaxpr(closed, [], *args)


def scalify(fn: Callable[..., Any], *, rounding: str = "pow2") -> Callable[..., Any]:
    """Propagates scales through ``fn`` when it is called with ScaledArrays.

    ``scalify(fn)(*args)`` traces ``fn`` on the data's shapes and dtypes and
    runs every operation on :class:`ScaledArray` inputs with a unit-scaling
    rule: the scale of a matmul or a sum grows with the square root of the
    contraction size, ``mul``/``div`` multiply scales, ``add`` combines them
    in quadrature, shape operations keep them, ``max``/``select``/
    ``concatenate`` align their operands on a common scale. Everything ``fn``
    does is covered: forward, ``jax.grad`` and the optimizer update.
    Called with no ScaledArray anywhere in its arguments, the function runs
    exactly as without ``scalify``. Wrap the result in ``jax.jit`` for
    speed, and differentiate inside it (``scalify(jax.grad(f))``):
    ``jax.grad(scalify(f))`` differentiates with respect to ``data`` and
    ``scale`` as two separate leaves.

    Args:
      fn: The function. Its arguments are pytrees of arrays and ScaledArrays.
      rounding: How new scales are rounded: ``"pow2"`` (default, nearest power
        of two: rescaling data is then exact), ``"e8m0"`` (power of two up)
        or ``"none"``.

    Returns:
      The wrapped function. Outputs computed from ScaledArrays are
      ScaledArrays; the others are plain arrays.

    Raises:
      UnsupportedPrimitiveError: At trace time, for a primitive without a
        scaled rule that gets a ScaledArray input (the message names it).
      InvalidArgumentError: For an unknown ``rounding``.

    Example:
      >>> import numpy as np
      >>> from qbits.scaled import as_scaled_array, scalify
      >>> add = scalify(lambda a, b: a + b)
      >>> a = as_scaled_array(np.array([1.0, 2.0], np.float16), np.float32(2))
      >>> b = as_scaled_array(np.array([3.0, 6.0], np.float16), np.float32(4))
      >>> add(a, b)
      ScaledArray(data=Array([1., 2.], dtype=float16), scale=4.0)
    """
    check_choice("scalify", "rounding", rounding, SCALE_ROUNDINGS)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=is_scaled)
        if not any(isinstance(x, ScaledArray) for x in leaves):
            return fn(*args, **kwargs)
        specs = [
            jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, ScaledArray) else x
            for x in leaves
        ]

        def flat_fn(*flat: Any) -> Any:
            a, k = jax.tree.unflatten(treedef, flat)
            return fn(*a, **k)

        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*specs)
        with _rounding(rounding):
            out = eval_jaxpr(closed.jaxpr, closed.consts, *leaves)
        out = [plain(x) for x in out]
        return jax.tree.unflatten(jax.tree.structure(out_shape), out)

    return wrapper
