"""Small helpers for jaxprs and abstract values across the supported JAX versions.

Shared by ``scalify`` (:mod:`qbits.scaled`) and the model transformation
(:mod:`qbits.transform`), the two places qbits re-runs a traced function
equation by equation; and :func:`varying`, which the quantizer and the
quantized matmuls read inside ``jax.shard_map``.
"""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["bind", "rebind_shard_map", "scan_counts", "shard_map_body", "varying"]


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


def shard_map_body(params: dict[str, Any]) -> tuple[Any, list[Any]]:
    """A ``shard_map`` equation's body: its open jaxpr and constants."""
    body = params["jaxpr"]
    return getattr(body, "jaxpr", body), list(getattr(body, "consts", ()))


def rebind_shard_map(params: dict[str, Any], fn: Any, args: list[Any]) -> list[Any]:
    """Runs ``fn`` as a ``shard_map`` equation of ``params`` runs its body.

    The same mesh, specs (one per flat operand and result), manual axes and
    check, through ``jax.shard_map``: ``fn`` replaces the body.
    """
    mapped = jax.shard_map(
        lambda *a: tuple(fn(*a)),
        mesh=params["mesh"],
        in_specs=tuple(params["in_specs"]),
        out_specs=tuple(params["out_specs"]),
        axis_names=params["newly_manual_axes"],
        check_vma=params["check_vma"],
    )
    return list(mapped(*args))


def varying(x: Any) -> frozenset:
    """The manual mesh axes along which ``x`` varies (inside ``shard_map``).

    Empty outside ``shard_map``, and for values that are the same on every
    shard (with ``check_vma=True``, JAX's default, the type says which).
    """
    mat = getattr(jax.typeof(x), "mat", None)
    return frozenset(getattr(mat, "varying", ()) or ())
