"""``adapt``: a function whose weight matmuls add an adapter's output.

The engine's entry point for adapters (low-rank adapters, :mod:`qbits.lora`):
the function is traced as :func:`qbits.quantize` traces it, the matmuls
run as the rules say (float, quantized, or on stored weights), and each
adapted weight matmul adds what an :class:`~._adapter.Adapter` computes
from its activation and its data. :func:`weight_matmuls` lists every matmul
and says which can be adapted, so that a caller can make each one's data
first.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax

from qbits._errors import InvalidArgumentError
from qbits.config import _as_quant_config
from qbits.transform._adapter import DATA, Adapter
from qbits.transform._observe import ObservedMatmul, describe
from qbits.transform._plan import Caller, Plan, entry_point
from qbits.transform._program import Program, Site, trace
from qbits.transform._runner import Frame, run_program
from qbits.transform._transform import (
    _check_key,
    _check_mapping,
    _check_names,
    _check_state,
    _checked_key,
    _stored_weights,
    table,
)

__all__ = ["WeightMatmul", "adapt", "weight_matmuls"]


@dataclasses.dataclass(frozen=True)
class WeightMatmul:
    """One matmul of a traced function, and whether it can be adapted.

    Attributes:
      path: Its path, as :func:`qbits.layer_table` names it.
      kind: Its kind, as in the layer table.
      operands: Its operand types, e.g. ``"f32[8,16] x f32[16,32]"``.
      matmul: How an adapter sees it (:class:`ObservedMatmul`: the weight's
        contraction, batch and free axes, stacked layers), or ``None`` for
        a matmul that cannot be adapted.
      why_not: Why it cannot be adapted (``"activation x activation"``...),
        or ``""``.
      exclusive: Whether this matmul is all that reads its weight's
        parameter (merging an adapter into the parameter then changes
        nothing else; a tied embedding's table is also looked up).
    """

    path: str
    kind: str
    operands: str
    matmul: ObservedMatmul | None
    why_not: str
    exclusive: bool = False


def _why_not(site: Site) -> str:
    """Why a site cannot be adapted, or ``""``."""
    if site.kept:
        return f"kept ({site.kept})"
    if site.op.limited:
        return site.op.limited
    if not site.weights:
        return "activation x activation (no weight)"
    if site.control:
        return f"inside a {site.control} body"
    if site.mapped:
        return "inside a shard_map body"
    return ""


def _matmuls(program: Program) -> dict[str, WeightMatmul]:
    readers: dict[Any, int] = {}
    for site in program.sites:
        for w in site.lhs | site.rhs:
            readers[w] = readers.get(w, 0) + 1
    out = {}
    for site in program.sites:
        if site.path in out:  # a kept matmul listed again (its branches)
            continue
        why = _why_not(site)
        matmul, exclusive = None, False
        if not why:
            matmul = describe(site, program, bool(site.lhs and not site.rhs))
            weight = next(iter(site.weights))
            exclusive = weight not in program.escaped and readers[weight] == 1
        out[site.path] = WeightMatmul(
            site.path, site.kind, site.operands, matmul, why, exclusive
        )
    return out


def weight_matmuls(
    caller: Caller,
    fn: Callable[..., Any],
    *args: Any,
    **kwargs: Any,
) -> dict[str, WeightMatmul]:
    """Every matmul of ``fn(params, *args)``, and whether it can be adapted.

    Traces ``fn`` (no computation). Weight ``dot_general`` s (dense layers,
    einsums, ``@`` with a parameter) outside ``cond``, ``while`` and
    ``shard_map`` bodies can be adapted; convolutions, matmuls of two
    activations and the ones the engine keeps as they are (integer
    operands, inside a custom gradient) cannot.

    Args:
      caller: Who calls (named in errors).
      fn: ``fn(params, *args, **kwargs)``; the parameters name the matmuls.
      *args: The parameters, then example arguments (arrays or
        ``jax.ShapeDtypeStruct`` s).
      **kwargs: Example keyword arguments.

    Returns:
      ``{path: WeightMatmul}``, in program order.
    """
    if not callable(fn):
        raise InvalidArgumentError(caller.owner, "fn", fn, "a function")
    return _matmuls(trace(fn, args, kwargs, 0, caller.owner))


@entry_point(Caller("qbits.transform.adapt"))
def adapt(  # noqa: D417 (caller: its public form has none)
    caller: Caller,
    fn: Callable[..., Any],
    config: Any,
    adapter: Adapter,
    adapters: Mapping[str, Any],
    key: jax.Array | None = None,
    *,
    stored: Mapping[str, Any] | None = None,
) -> Callable[..., Any]:
    """``fn`` with each weight matmul of ``adapters`` adapted by ``adapter``.

    :func:`qbits.quantize` (the same tracing, names, rules, keys and
    stored weights), with the weight matmuls named in ``adapters`` adding
    ``adapter.apply(matmul, rows, adapters[path], key)`` to their output,
    and multiplying ``adapter.before(matmul, rows, adapters[path])`` instead
    of their activation where the adapter has ``before``. Gradients reach
    the adapters' data through both (and the activation).

    Args:
      fn: ``fn(params, *args, **kwargs)``.
      config: The rules the matmuls themselves run with, as for
        :func:`qbits.quantize` (``None``: float).
      adapter: What the adapted matmuls add.
      adapters: ``{matmul path: data}``: which weight matmuls are adapted,
        and their data (stacked along the scans that slice their weight).
      key: PRNG key: for stochastic rounding, and for the adapter when it
        draws random numbers (``adapter.needs_key``).
      stored: Stored weights, as for :func:`qbits.quantize`.

    Returns:
      A function with ``fn``'s signature and outputs.

    Raises:
      InvalidArgumentError: For a path in ``adapters`` that is not a
        matmul of ``fn`` that can be adapted (naming it and why), a missing
        ``key``, configs that keep scale state, and the errors of
        :func:`qbits.quantize`.

    Example:
      >>> def f(params, x):
      ...     return x @ params["w"]
      >>> params, x = {"w": jnp.ones((4, 2))}, jnp.ones((3, 4))
      >>> low_rank = qbits.transform.Adapter(
      ...     lambda m, rows, ab, key: (rows @ ab["a"]) @ ab["b"])
      >>> ab = {"a": jnp.ones((4, 1)), "b": jnp.ones((1, 2))}
      >>> adapted = qbits.transform.adapt(f, "int8_fwd", low_rank, {"w": ab})
      >>> adapted(params, x).tolist()[0]  # 4 (int8 x int8) + 4 (adapter)
      [8.0, 8.0]
    """
    quant = _as_quant_config(caller.owner, config, allow_none=True)
    if not callable(fn):
        raise InvalidArgumentError(caller.owner, "fn", fn, "a function")
    if not isinstance(adapter, Adapter) or (
        adapter.apply is None and adapter.before is None
    ):
        raise InvalidArgumentError(
            caller.owner,
            "adapter",
            adapter,
            "a qbits.transform.Adapter with apply (what it adds to the output), "
            "before (what it makes of the input) or both",
        )
    _check_mapping(caller, "adapters", adapters, "a mapping {matmul path: data}")
    if key is not None:
        key = _checked_key(caller, key)
    if adapter.needs_key and key is None:
        raise InvalidArgumentError(
            caller.owner,
            caller.key,
            None,
            "a PRNG key (jax.random.key(...))",
            why="the adapter draws random numbers",
        )
    if stored is not None:
        stored = _stored_weights(caller, stored)
    names = frozenset(adapters)

    @functools.wraps(fn)
    def adapted(*args: Any, **kwargs: Any) -> Any:
        program = trace(fn, args, kwargs, 0, caller.owner)
        _check_adaptable(caller, program, names)
        plan = Plan(
            program, quant, caller, store=stored is not None,
            adapter=adapter, adapted=names,
        )  # fmt: skip
        _check_key(key, plan)
        _check_state(None, plan)
        if stored is not None:
            _check_names(caller, "stored", stored, plan.stored.values(),
                         "stored with this config: qbits.serving.convert "
                         "stores them, qbits.serving.serve runs them",
                         "their forward configs quantize a weight")  # fmt: skip
        if caller.whole:
            table(program, quant).warn_unused()
        data = {DATA + name: value for name, value in adapters.items()}
        frame = Frame(key, {**(stored or {}), **data})
        out = run_program(program, plan, frame, args, kwargs)
        return jax.tree.unflatten(program.out_tree, out)

    return adapted


def _check_adaptable(caller: Caller, program: Program, names: frozenset[str]) -> None:
    """Raises unless every name is a weight matmul of the program to adapt."""
    found = _matmuls(program)
    for name in sorted(names):
        m = found.get(name)
        if m is not None and not m.why_not:
            continue
        ok = [p for p, w in found.items() if not w.why_not]
        listed = ", ".join(ok[:4]) + (f" and {len(ok) - 4} more" if len(ok) > 4 else "")
        raise InvalidArgumentError(
            caller.owner,
            f"adapters[{name!r}]",
            "data",
            f"data for weight matmuls only ({listed or 'it has none'})",
            why=f"{name!r} is {m.why_not}" if m else f"{name!r} is no matmul of fn",
        )
