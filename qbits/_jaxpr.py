"""Small helpers for interpreting jaxprs across the supported JAX versions.

Shared by ``scalify`` (:mod:`qbits.scaled`) and the model transformation
(:mod:`qbits.transform`), the two places qbits re-runs a traced function
equation by equation.
"""

from __future__ import annotations

from typing import Any

__all__ = ["bind", "scan_counts"]


def bind(eqn: Any, invals: list[Any]) -> Any:
    """Runs one equation's primitive on ``invals`` as JAX would."""
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns: list[Any] = []
    if isinstance(params, tuple):  # JAX < 0.8 returned (subfuns, params)
        subfuns, params = params
    with eqn.ctx.manager:
        return eqn.primitive.bind(*subfuns, *invals, **params)


def scan_counts(params: dict[str, Any]) -> tuple[int, int]:
    """How many of a scan's inputs are constants and carries.

    jax before 0.12 gives the counts; from 0.12 on, ``ft_in`` holds the
    (constants, carry, scanned) parts, one entry per flat input.
    """
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    # A flat tree of (constants, carry, scanned): count each part's values.
    consts, carry, _ = params["ft_in"].unpack()
    return len(list(consts.vals)), len(list(carry.vals))
