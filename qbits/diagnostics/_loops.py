"""Which inputs of a function flow into a ``lax.while_loop``.

Diagnostics are read in reverse mode (the probes' gradient), and JAX cannot
differentiate a ``while_loop`` (nor a ``fori_loop`` with traced bounds) in
reverse mode: an input whose value reaches one cannot be differentiated.
:func:`into_while` finds those inputs from the function's jaxpr, so that
:func:`qbits.diagnostics.diagnose` measures everything else.
"""

from __future__ import annotations

from typing import Any

from jax.extend import core as jcore

__all__ = ["into_while"]


def into_while(jaxpr: Any) -> list[bool]:
    """For each input of ``jaxpr``: whether its value reaches a while_loop.

    Conservative: an equation's outputs depend on all its inputs, and the
    bodies of calls, scans, conds and remat are followed. The rules of
    ``custom_jvp``/``custom_vjp`` functions are not looked into (JAX
    differentiates them by their rule, not through their body).

    Example:
      >>> def f(x, y, z):
      ...     w = jax.lax.while_loop(lambda c: c < 3.0, lambda c: c + y, x)
      ...     return w * z
      >>> into_while(jax.make_jaxpr(f)(1.0, 1.0, 1.0).jaxpr)
      [True, True, False]
    """
    deps: dict[Any, frozenset[int]] = {
        v: frozenset([i]) for i, v in enumerate(jaxpr.invars)
    }
    hit: set[int] = set()
    for eqn in jaxpr.eqns:
        ins = [
            deps.get(v, frozenset()) if isinstance(v, jcore.Var) else frozenset()
            for v in eqn.invars
        ]
        name = eqn.primitive.name
        if name == "while":
            hit.update(*ins)
        elif not name.startswith("custom_"):
            for sub in jcore.jaxprs_in_params(eqn.params):
                skip = int(name == "cond")  # a cond's branch index
                if len(ins) - skip != len(sub.invars):  # not one to one
                    if _has_while(sub):
                        hit.update(*ins)
                    continue
                for j, reached in enumerate(into_while(sub)):
                    if reached:
                        hit.update(ins[skip + j])
        out = frozenset().union(*ins)
        for v in eqn.outvars:
            deps[v] = out
    return [i in hit for i in range(len(jaxpr.invars))]


def _has_while(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` runs a while_loop, at any depth."""
    return any(
        eqn.primitive.name == "while"
        or any(_has_while(s) for s in jcore.jaxprs_in_params(eqn.params))
        for eqn in jaxpr.eqns
    )
