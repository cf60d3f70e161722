"""Forward-mode differentiation of a quantized matmul: refused, clearly.

The quantized matmuls are a ``jax.custom_vjp`` (:mod:`qbits.ops._core`):
they have reverse mode (``jax.grad``, ``jax.vjp``, ``jax.jacrev``) and, on
top of it, derivatives of any order (``jax.hessian``, ``jax.jvp`` or
``jax.linearize`` of a gradient), but no forward mode of their own. JAX
reports that with a ``TypeError`` about ``custom_vjp`` only when the
forward derivative is evaluated: inside ``jit``, when the program is
compiled; after ``jax.linearize``, when its linear function is applied.

:func:`reverse_mode_only` passes the operands through unchanged and puts a
marker on their tangents: reverse mode transposes it away (nothing of it
reaches the program), evaluating it raises :class:`~qbits.InvalidArgumentError`
with what to do instead, before JAX's own error.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.custom_derivatives import SymbolicZero
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

from qbits._errors import InvalidArgumentError

__all__ = ["forward_mode_error", "reverse_mode_only"]


def forward_mode_error() -> InvalidArgumentError:
    """The error for a forward-mode derivative of a quantized matmul."""
    return InvalidArgumentError(
        "qbits quantized matmul",
        "differentiation",
        "forward-mode (jax.jvp, jax.jacfwd or jax.linearize of the matmul itself)",
        "reverse mode: jax.grad, jax.vjp, jax.jacrev (the quantized backward "
        "matmuls are a custom VJP, which has no forward mode); forward mode "
        "works on top of it: jax.jvp, jax.linearize or jax.jacfwd of a "
        "gradient, jax.hessian; for a JVP of the forward quantization alone "
        "use fake quantization, e.g. Quantizer.quant(x).dequant()",
    )


def _refuse(*args: Any, **params: Any) -> Any:
    raise forward_mode_error()


_marker_p = jex_core.Primitive("qbits_forward_mode")
_marker_p.def_impl(_refuse)
_marker_p.def_abstract_eval(lambda t: t)
ad.deflinear2(_marker_p, lambda ct, t: [ct])
batching.primitive_batchers[_marker_p] = lambda args, dims: (
    _marker_p.bind(*args),
    dims[0],
)
mlir.register_lowering(_marker_p, _refuse)


@jax.custom_jvp
def reverse_mode_only(tree: Any) -> Any:
    """``tree`` itself; a forward-mode derivative through it raises.

    Raises:
      InvalidArgumentError: When a tangent that came through it is evaluated
        (``jax.jvp``, ``jax.jacfwd``, the function from ``jax.linearize``),
        not when it is transposed (reverse mode).
    """
    return tree


def _reverse_mode_only_jvp(primals: Any, tangents: Any) -> Any:
    (tree,), (t,) = primals, tangents
    marked = jax.tree.map(
        lambda t: t if isinstance(t, SymbolicZero) else _marker_p.bind(t),
        t,
        is_leaf=lambda t: isinstance(t, SymbolicZero),
    )
    # The primal is plain: a level of differentiation above this one may be
    # forward mode (jax.jvp of a gradient), which goes through the custom
    # VJP's own rules, not through its missing forward mode.
    return tree, marked


reverse_mode_only.defjvp(_reverse_mode_only_jvp, symbolic_zeros=True)
