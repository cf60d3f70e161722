"""Derivatives of a gradient: the quantized matmuls, straight-through.

The first derivative of a quantized matmul is its custom VJP
(:mod:`qbits.ops._core`): the configured backward matmuls, with the
numerics' gradient (straight-through, masked where ``clip_gradient``
says). A second derivative (``jax.hessian``, ``jax.jvp`` or
``jax.linearize`` of a gradient, a gradient of a gradient) differentiates
the rules of that VJP: the forward pass, which rounds (derivative zero),
and the backward matmuls, which round the output gradient. Both are
given straight-through derivatives here, at every order:

- the forward output ``C(Q(lhs), Q(rhs))`` has the derivative
  ``C(dlhs, Q(rhs)) + C(Q(lhs), drhs)``;
- a backward matmul ``C_l(Q(g), Q'(other))`` has the derivative
  ``C_l(dg, Q'(other))`` in ``g``.

Each is the derivative of the same computation in float, its
quantizations replaced by :func:`straight_through` (the quantized values,
whose derivative is the numerics' gradient): linear in the tangents, so
reverse mode can transpose it, and made of the same parts, so the next
order is straight-through too. The values are the quantized matmuls'
own, bit for bit; only their derivatives are new.

The backward matmuls keep the forward operands as quantized codes (an
int8 or fp8 array, a quarter of float32's bytes), which carry no
derivative. A derivative that has to go through them, a mixed second
derivative such as ``d(grad lhs)/d rhs``, is refused
(:func:`through_codes_error`) rather than silently zero.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.custom_derivatives import SymbolicZero, zero_from_primal

from qbits._errors import InvalidArgumentError

__all__ = ["instantiate", "straight_through", "through_codes_error"]

Grad = jax.tree_util.Partial


@jax.custom_jvp
def straight_through(x: jax.Array, q: jax.Array, grad: Grad) -> jax.Array:
    """``q`` (``x`` quantized), with the derivative ``grad(dx)`` at every order.

    Args:
      x: The tensor.
      q: ``x`` quantized and dequantized (same shape and dtype).
      grad: The numerics' gradient (from :meth:`qbits.Quantizer.quant_vjp`):
        elementwise, the identity or a mask.
    """
    return q


def _straight_through_jvp(primals: Any, tangents: Any) -> Any:
    x, q, grad = primals
    return straight_through(x, q, grad), grad(tangents[0])


straight_through.defjvp(_straight_through_jvp)


def instantiate(tangent: Any, primal: Any) -> Any:
    """``tangent`` (a pytree like ``primal``) with its symbolic zeros made zeros."""
    return jax.tree.map(
        lambda t, p: zero_from_primal(p) if isinstance(t, SymbolicZero) else t,
        tangent,
        primal,
        is_leaf=lambda t: isinstance(t, SymbolicZero),
    )


def through_codes_error(matmul: str, tensor: str) -> InvalidArgumentError:
    """The error for a derivative through the codes ``matmul`` keeps of ``tensor``."""
    side = "lhs" if matmul == "dlhs" else "rhs"
    return InvalidArgumentError(
        "qbits quantized matmul",
        "differentiation",
        f"a mixed second derivative, of the {side} gradient in {tensor}",
        "second derivatives with respect to one operand of each quantized "
        "matmul (e.g. jax.hessian with respect to the input, or to one "
        "weight; a Hessian-vector product of one weight; a tangent of zeros "
        "counts, leave the operand out of jax.jvp instead), or a config "
        "whose backward matmuls keep float operands (dlhs.rhs and drhs.rhs "
        "without quantization, use_fwd_quant=False; as in int8_fwd)",
        why=f"the {matmul} backward matmul keeps {tensor} as quantized codes, "
        "which carry no derivative",
    )
