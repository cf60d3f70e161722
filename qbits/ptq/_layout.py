"""Where a weight matmul's operand reads its parameter: an index map.

The engine follows a parameter through the operations that only move or
re-type it (transposes, reshapes, slices, casts, a scan over stacked
layers) to the matmul that multiplies by it, so the weight operand a
matmul sees need not be the parameter as it is stored: Hugging Face's
Flax GPT-2 stores every kernel ``(out, in)`` and transposes it before
multiplying; an attention projection stored ``(D, heads * dim)`` may be
reshaped to ``(D, heads, dim)``. :func:`operand_indices` finds, for each
weight matmul, which entry of the parameter each entry of its operand is.

Where the function rearranges no parameter (its jaxpr applies no such
operation to one: most models), every operand is its parameter as it is.
Otherwise the engine stores the weights (its ``store_weights``,
one compile) of the model with every parameter replaced by the digits of
its entries' flat indices, on an exact 16-bit integer grid (scale 1):
base-256 digits, which every float dtype a weight may be cast to on the
way (bfloat16 holds the integers up to 256) keeps exactly.

A rearrangement (a transpose, a reshape, a reversal) reads each entry
exactly once: the operand can be quantized in the matmul's layout and
written back into the parameter (:func:`qbits.ptq.quantize_weights`,
:func:`qbits.lora.merge`). A broadcast reads entries several times, a
slice only some: :func:`check_rearranged` refuses them, naming the matmul.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from qbits import transform
from qbits._calibration import ConstantBound
from qbits._errors import InvalidArgumentError
from qbits._quantizer import Quantizer
from qbits.config import QuantConfig, Rule
from qbits.numerics import IntNumerics
from qbits.ops import DotGeneralConfig, MatmulConfig

__all__ = ["check_rearranged", "indices", "operand_indices"]

_OWNER = "qbits.ptq.operand_indices"
_TOP = 2**15 - 1  # the 16-bit grid's largest code; the scale is 1 exactly
_EXACT = DotGeneralConfig(
    fwd=MatmulConfig(
        rhs=Quantizer(
            IntNumerics(bits=16, preserve_max_val=True),
            calibration=ConstantBound(float(_TOP)),
        )
    )
)
# Digits that every float dtype a model may cast a weight to on its way
# to the matmul (bfloat16: 8 significant bits) holds exactly.
_BASE = 256
# Operations that keep a value's entries where they are (casts, copies,
# placement): a parameter read through only these (and the slicing of a
# scan over stacked layers) is its operand as it is.
_IN_PLACE = frozenset(
    (
        "convert_element_type", "copy", "copy_p", "reduce_precision",
        "sharding_constraint", "mesh_cast", "reshard", "pvary", "device_put",
        "optimization_barrier",
    )
)  # fmt: skip
# Operations the engine follows a weight through that move its entries.
_REARRANGE = frozenset(
    (
        "reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims",
        "slice", "dynamic_slice", "rev", "real",
    )
)  # fmt: skip


def operand_indices(
    fn: Callable[..., Any],
    params: Any,
    *args: Any,
    paths: Iterable[str] | None = None,
    **kwargs: Any,
) -> dict[str, np.ndarray | None]:
    """Which entry of its parameter each entry of a weight matmul's operand is.

    A weight matmul that multiplies by its parameter as it is (``x @ w``,
    ``Dense``, an einsum; the layers of a scan over stacked layers) gets
    ``None``; one that transposes it first gets the transposed indices of
    its entries (a scan's layers stacked first). Traces ``fn``; where it
    rearranges a parameter, also runs the engine's storing pass
    (``store_weights``, compiled once) on the digits of
    the parameters' indices.

    Args:
      fn: ``fn(params, *args, **kwargs)``.
      params: Its parameters (arrays, or ``jax.ShapeDtypeStruct`` s: only
        shapes and dtypes matter).
      *args: Sample arguments (arrays or ``jax.ShapeDtypeStruct`` s).
      paths: The weight matmuls, as :func:`qbits.layer_table` names them;
        ``None``: every weight ``dot_general`` outside ``cond``, ``while``
        and ``shard_map`` bodies.
      **kwargs: Sample keyword arguments.

    Returns:
      ``{matmul path: index}``: ``index`` an int64 array of the shape of the
      weight operand (stacked along the scans that slice the parameter,
      as :attr:`MatmulStats.layers` says), of flat indices into the
      parameter: ``w.reshape(-1)[index]`` is the operand; or ``None``
      where the operand is ``w`` itself. Matmuls inside a ``cond``,
      ``while`` or ``shard_map`` body, and paths that are no such matmul, are left out.

    Example:
      >>> def gpt2_mlp(params, x):  # kernels stored (out, in), as Conv1D
      ...     return x @ params["c_fc"].T
      >>> params, x = {"c_fc": jnp.ones((3, 2))}, jnp.ones((1, 2))
      >>> qbits.ptq._operand_indices(gpt2_mlp, params, x)
      {'c_fc': array([[0, 2, 4],
             [1, 3, 5]])}
      >>> w = {"w": jnp.ones((2, 3))}
      >>> qbits.ptq._operand_indices(lambda p, x: x @ p["w"], w, x)
      {'w': None}
    """
    caller = transform._Caller(_OWNER)
    found = transform._weight_matmuls(caller, fn, params, *args, **kwargs)
    matmuls = {p: m.matmul for p, m in found.items() if m.matmul is not None}
    if paths is not None:
        matmuls = {p: matmuls[p] for p in dict.fromkeys(paths) if p in matmuls}
    return indices(fn, params, args, kwargs, matmuls)


def indices(
    fn: Callable[..., Any],
    params: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    matmuls: Mapping[str, Any],
) -> dict[str, np.ndarray | None]:
    """The index map of each of ``matmuls`` (:func:`operand_indices`).

    Args:
      fn: As for :func:`operand_indices`.
      params: As for :func:`operand_indices`.
      args: The sample arguments.
      kwargs: The sample keyword arguments.
      matmuls: ``{path: ObservedMatmul}`` (the engine's ``weight_matmuls``).

    Returns:
      ``{path: index}``, as :func:`operand_indices` returns it.
    """
    identity = {path: None for path in matmuls}
    if not matmuls:
        return identity
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    arrays = [i for i, (_, leaf) in enumerate(leaves) if _is_array(leaf)]
    specs = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype) if _is_array(a) else a,
        (args, kwargs),
    )
    params_of = functools.partial(_unflatten, leaves, treedef, arrays)
    if not _rearranged(fn, [leaves[i][1] for i in arrays], specs, params_of):
        return identity
    sizes = [math.prod(np.shape(leaves[i][1])) for i in arrays]
    passes = max([1, *(math.ceil(math.log(n, _BASE)) for n in sizes if n > 1)])
    config = _exact_rules(list(matmuls))
    caller = transform._Caller(_OWNER, whole=False)

    def store(probe: list[Any]) -> dict[str, jax.Array]:
        stored = transform._store_weights(
            caller, fn, config, params_of(probe), *specs[0], **specs[1]
        )
        return {path: s.weight.qvalue for path, s in stored.items()}

    # Every digit in one run (one compile): the digits are a vmapped axis.
    digits = jax.vmap(store)(
        [_digits(leaves[i][1], n, passes) for i, n in zip(arrays, sizes, strict=True)]
    )
    weights = np.asarray(_BASE ** np.arange(passes), np.int64)
    out = {}
    for path, m in matmuls.items():
        if path in digits:
            index = np.tensordot(weights, np.asarray(digits[path], np.int64), axes=1)
            out[path] = None if _as_it_is(index, m.param_shape) else index
    return out


def _as_it_is(index: np.ndarray, shape: tuple[int, ...]) -> bool:
    """Whether ``index`` reads the parameter of ``shape`` as it is."""
    return index.shape == tuple(shape) and np.array_equal(
        index.reshape(-1), np.arange(index.size)
    )


def _rearranged(
    fn: Callable[..., Any], params: list[Any], specs: Any, full: Callable[..., Any]
) -> bool:
    """Whether ``fn`` rearranges one of the parameters (array leaves ``params``)."""
    rest, tree = jax.tree.flatten(specs, is_leaf=_is_array)
    dyn = [i for i, x in enumerate(rest) if _is_array(x)]

    def call(probe: list[Any], values: list[Any]) -> Any:
        filled = list(rest)
        for i, x in zip(dyn, values, strict=True):
            filled[i] = x
        a, k = jax.tree.unflatten(tree, filled)
        return fn(full(probe), *a, **k)

    closed = jax.make_jaxpr(call)(
        [jax.ShapeDtypeStruct(np.shape(p), p.dtype) for p in params],
        [rest[i] for i in dyn],
    )
    n = len(closed.jaxpr.invars)
    return _rearranges(closed.jaxpr, [i < len(params) for i in range(n)])[0]


def _unflatten(
    leaves: list[tuple[Any, Any]], treedef: Any, arrays: list[int], values: list[Any]
) -> Any:
    """The parameters with their array leaves replaced by ``values``."""
    full = [leaf for _, leaf in leaves]
    for i, x in zip(arrays, values, strict=True):
        full[i] = x
    return jax.tree_util.tree_unflatten(treedef, full)


def _sub_jaxprs(params: Mapping[str, Any]) -> list[Any]:
    """The open jaxprs an equation's parameters hold."""
    found = []
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jcore.ClosedJaxpr):
                found.append(item.jaxpr)
            elif isinstance(item, jcore.Jaxpr):
                found.append(item)
    return found


def _rearranges(jaxpr: Any, tracked: list[bool]) -> tuple[bool, list[bool]]:
    """Whether a parameter (``tracked`` inputs) meets a rearranging operation.

    Returns it, and which outputs are parameters. Conservative: a parameter
    is followed through in-place operations and into every body (all of a
    body's inputs, where they do not pair with the equation's; then all
    its outputs).
    """
    env = {v for v, t in zip(jaxpr.invars, tracked, strict=True) if t}
    for eqn in jaxpr.eqns:
        ins = [not isinstance(v, jcore.Literal) and v in env for v in eqn.invars]
        if not any(ins):
            continue
        if eqn.primitive.name in _REARRANGE:
            return True, []
        if eqn.primitive.name in _IN_PLACE:
            env.update(eqn.outvars)
        for sub in _sub_jaxprs(eqn.params):
            pairs = len(sub.invars) == len(ins)
            found, outs = _rearranges(sub, ins if pairs else [True] * len(sub.invars))
            if found:
                return True, []
            if pairs and len(outs) == len(eqn.outvars):
                env.update(v for v, t in zip(eqn.outvars, outs, strict=True) if t)
            elif any(outs):
                env.update(eqn.outvars)
    return False, [not isinstance(v, jcore.Literal) and v in env for v in jaxpr.outvars]


def _exact_rules(paths: list[str]) -> QuantConfig:
    """Rules giving exactly ``paths`` the exact grid, every other matmul float.

    A rule for ``w`` also matches the later uses ``w#2``...: those not in
    ``paths`` get an explicit float rule first.
    """
    later = [Rule(re.escape(p), _EXACT) for p in paths if "#" in p]
    guards = [
        Rule(re.escape(b) + r"#\d+", None)
        for b in dict.fromkeys(p.split("#", 1)[0] for p in paths)
    ]
    plain = [Rule(re.escape(p), _EXACT) for p in paths if "#" not in p]
    return QuantConfig(rules=(*later, *guards, *plain), default=None)


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def _digits(leaf: Any, n: int, passes: int) -> Any:
    """The digits of each entry's flat index, low first, stacked (float leaves)."""
    dtype = jax.dtypes.canonicalize_dtype(leaf.dtype)  # float64 without x64: f32
    shape = (passes, *np.shape(leaf))
    if not jnp.issubdtype(dtype, jnp.floating):
        return np.zeros(shape, dtype)
    index = np.arange(n, dtype=np.int64)
    values = np.stack([(index // _BASE**j) % _BASE for j in range(passes)])
    return jnp.asarray(values.astype(np.float32).reshape(shape), dtype)


def check_rearranged(
    owner: str, path: str, param: str, index: np.ndarray, size: int
) -> None:
    """Raises unless ``index`` reads each of ``size`` entries exactly once.

    A transpose, a reshape or a reversal does; a broadcast reads entries
    several times, a slice only some (and a ``dynamic_slice`` other ones on
    other inputs): a quantized operand then has no parameter to be.

    Args:
      owner: Who asks, for the message.
      path: The matmul.
      param: Its parameter's key path.
      index: The matmul's operand indices (:func:`operand_indices`).
      size: The parameter's size.
    """
    flat = index.reshape(-1)
    distinct = np.unique(flat).size
    if distinct == flat.size == size:
        return
    if distinct < flat.size:
        how = f"broadcasts (its {flat.size} entries repeat {distinct} of the {size})"
    else:
        how = f"slices (its {flat.size} entries are {distinct} of the {size})"
    raise InvalidArgumentError(
        owner,
        "fn",
        f"the weight matmul {path!r}",
        "a model whose weight matmuls read their parameters whole, as they "
        "are or rearranged (transposed, reshaped): quantize the parts as "
        "parameters of their own, or keep this matmul's weight float (a "
        "rule with config None)",
        why=f"the model {how} parameter {param} before {path!r} multiplies "
        "by it: a quantized operand does not write back into the parameter",
    )
