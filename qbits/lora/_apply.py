"""``apply``: low-rank adapters on an unmodified model, over a frozen base.

The model (a function of its parameters, a linen module, an nnx module) is
traced once by the engine (its ``weight_matmuls``): every
weight matmul is found and named as :func:`qbits.layer_table` names it,
the :class:`~qbits.lora.LoraConfig`'s rules choose the adapted ones, and
each gets ``A`` (initialised) and ``B`` (zeros). The base's weight matmuls
that ``config.base`` quantizes get their weights stored once
(the engine's ``store_weights``: int4 and NF4 packed two per byte),
and the float parameters they replace become empty placeholders: the
frozen base is :class:`~qbits.lora.LoraBase`. The adapted function
(:class:`~qbits.lora.LoraFunction`) runs the model through
:func:`qbits.transform.adapt`.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
from flax.core import FrozenDict, unfreeze

from qbits import nnx as qnnx
from qbits import transform
from qbits._errors import ConfigError, InvalidArgumentError
from qbits._sharding import like
from qbits.config import QuantConfig, Rule, _resolve
from qbits.lora._config import LoraConfig
from qbits.lora._function import AdaptedLayer, Lora, LoraBase, LoraFunction
from qbits.numerics import _check_key as check_key
from qbits.ptq import _operand_indices as operand_indices

__all__ = ["apply"]

_OWNER = "qbits.lora.apply"


def _model(model: Any, args: tuple[Any, ...]) -> tuple[Callable, Any, tuple]:
    """``(fn, params, sample args)`` of a function, linen module or nnx module."""
    if isinstance(model, nnx.Module):
        fn, params = qnnx.as_function(model)
        return fn, params, args
    if not (isinstance(model, nn.Module) or callable(model)):
        raise InvalidArgumentError(
            _OWNER, "model", model,
            "a function fn(params, *args), a flax.linen.Module or a flax.nnx.Module",
        )  # fmt: skip
    if not args:
        raise InvalidArgumentError(
            _OWNER, "params", None,
            "the model's float parameters, then sample inputs: "
            "apply(fn, config, params, x, key=key)",
        )  # fmt: skip
    fn = model.apply if isinstance(model, nn.Module) else model
    params = args[0]
    if isinstance(params, FrozenDict):
        params = unfreeze(params)
    return fn, params, args[1:]


def _config(config: Any) -> LoraConfig:
    return _resolve(_OWNER, config, LoraConfig)


def apply(model: Any, config: Any, *args: Any, key: Any, **kwargs: Any) -> Lora:
    """Low-rank adapters on every weight matmul the rules match, base frozen.

    Traces the model (no computation) and finds every matmul as
    :func:`qbits.quantize` does, wherever it is written: Flax layers,
    custom layers, raw ``jnp.einsum`` and ``@``, scanned layers. The rules
    of ``config`` choose the weight matmuls that get adapters; the rest
    run as they are. The base's weights are frozen: held quantized where
    ``config.base`` quantizes them (stored once, packed), float otherwise.

    Args:
      model: A function ``fn(params, *args, **kwargs)`` of any pytree of
        parameters, a linen module (its ``apply``), or an nnx module (its
        ``__call__`` over its state, as :func:`qbits.nnx.as_function`).
      config: A :class:`~qbits.lora.LoraConfig`, or the path of a YAML
        file holding one.
      *args: Functions and linen modules: the float parameters (the linen
        variables), then sample inputs. nnx modules: sample inputs. Sample
        inputs may be ``jax.ShapeDtypeStruct`` s (only shapes matter).
      key: PRNG key for the adapters' ``A`` (each matmul's from the key and
        its path: another rule leaves the others' ``A`` unchanged).
      **kwargs: Keyword arguments of the model.

    Returns:
      :class:`Lora`: ``(fn, base, adapters)``. ``fn(adapters, base, x)``
      equals the model on the base (quantized where the base quantizes it)
      while ``B`` is zero.

    Raises:
      ConfigError: For a rule that matches no matmul, an adapting rule
        that matches only matmuls without a weight (activation x
        activation, convolutions, kept ones), a rank larger than a
        matmul's contraction or output size (naming the matmul), a base
        config that quantizes activations, or one that does not fit a
        matmul; when nothing is adapted.
      InvalidArgumentError: For a bad model, config, parameters or key.

    Example:
      >>> def f(params, x):  # a raw einsum and an attention-like product
      ...     q = jnp.einsum("btd,dh->bth", x, params["wq"])
      ...     return jnp.einsum("bth,bsh->bts", q, q)
      >>> params = {"wq": jnp.ones((64, 16))}
      >>> x = jnp.ones((2, 3, 64))
      >>> fn, base, adapters = qbits.lora.apply(
      ...     f, qbits.lora.LoraConfig(rank=2, base="nf4"), params, x,
      ...     key=jax.random.key(0))
      >>> [(la.path, la.rank, la.base) for la in fn.layers]
      [('wq', 2, 'nf4'), ('bth,bsh->bts', None, 'float')]
      >>> start = fn(adapters, base, x)  # B = 0: the NF4 base model
      >>> bool((start == qbits.quantize(f, fn.base_rules)(params, x)).all())
      True
    """
    config = _config(config)
    fn, params, args = _model(model, args)
    key = check_key(_OWNER, key)
    if not jax.tree.leaves(params):
        raise InvalidArgumentError(
            _OWNER, "params", type(params).__name__,
            "the model's float parameters (a pytree of arrays)",
        )  # fmt: skip
    caller = transform._Caller(_OWNER)
    found = transform._weight_matmuls(caller, fn, params, *args, **kwargs)
    chosen = _choose(config, found)
    base_rules, stored_rules = _base_rules(config, found)
    stored = {}
    if stored_rules.rules:
        try:
            stored = transform._store_weights(
                caller, fn, stored_rules, params, *args, **kwargs
            )
        except ConfigError as e:  # named as in the base config
            raise _in_base(e, base_rules, stored_rules) from None
    base = _frozen_base(params, stored)
    # Where each adapted or stored weight sits in its parameter, for merge.
    folded = [p for p in found if chosen[p][1] is not None or p in stored]
    indices = operand_indices(fn, params, *args, paths=folded, **kwargs)
    layers = []
    for path, m in found.items():
        rule, ra = chosen[path]
        rank, alpha = ra if ra is not None else (None, None)
        why_not = "" if ra is not None else (
            m.why_not or (f"rules[{rule}]: adapt=False" if rule is not None
                          else "no rule matches")
        )  # fmt: skip
        held = base_rules.resolve(path).name or "inline" if path in stored else "float"
        layers.append(
            AdaptedLayer(
                path, m.kind, m.operands, rank, alpha, rule, why_not, held,
                merge=_merge_check(m, indices.get(path))
                if ra is not None or path in stored else "",
                matmul=m.matmul, index=indices.get(path),
            )
        )  # fmt: skip
    lora_fn = LoraFunction(fn, config, tuple(layers), stored_rules)
    adapters = _init_all(config, layers, key, params)
    return Lora(lora_fn, base, adapters)


def _choose(
    config: LoraConfig, found: dict[str, transform._WeightMatmul]
) -> dict[str, tuple[int | None, tuple[int, float] | None]]:
    """Each matmul's deciding rule and ``(rank, alpha)``; checks the rules."""
    chosen = {}
    matched: dict[int, list[str]] = {}
    weights: dict[int, list[str]] = {}
    for path, m in found.items():
        rule, ra = config.resolve(path)
        if rule is not None:
            matched.setdefault(rule, []).append(path)
            if not m.why_not:
                weights.setdefault(rule, []).append(path)
        if m.why_not:
            ra = None
        chosen[path] = (rule, ra)
    adaptable = [p for p, m in found.items() if not m.why_not]
    listed = ", ".join(adaptable[:6]) + (" ..." if len(adaptable) > 6 else "")
    for i, rule in enumerate(config.rules):
        if i not in matched:
            raise ConfigError(
                f"rules[{i}].pattern", rule.pattern,
                f"a pattern that matches a matmul of the model (its weight "
                f"matmuls: {listed or 'none'})",
                why="it matches no matmul (or earlier rules match all it does)",
            )  # fmt: skip
        if rule.adapt and i not in weights:
            first = found[matched[i][0]]
            raise ConfigError(
                f"rules[{i}].pattern", rule.pattern,
                f"a pattern that matches weight matmuls (an adapter needs a "
                f"weight: {listed or 'the model has none'})",
                why=f"it matches only {', '.join(matched[i][:3])}: "
                f"{first.why_not}",
            )  # fmt: skip
    for path, (rule, ra) in chosen.items():
        if ra is None:
            continue
        m = found[path].matmul
        limit = min(m.k, m.n)
        if ra[0] > limit:
            where = (
                f"rules[{rule}].rank"
                if config.rules[rule].rank is not None  # type: ignore[index]
                else "rank"
            )
            raise ConfigError(
                where, ra[0],
                f"an int in 1..{limit} (min of the contraction size K={m.k} and "
                f"the output size N={m.n})",
                why="a larger rank adds nothing a full-rank update lacks",
                layer=path,
            )  # fmt: skip
    if not any(ra is not None for _, ra in chosen.values()):
        raise ConfigError(
            "rules", [r.pattern for r in config.rules],
            f"rules that adapt a weight matmul ({listed or 'the model has none'})",
            why="no matmul gets an adapter",
        )  # fmt: skip
    return chosen


def _base_rules(
    config: LoraConfig, found: dict[str, transform._WeightMatmul]
) -> tuple[QuantConfig, QuantConfig]:
    """The base's rules, and rules for exactly the weight matmuls it stores.

    Raises:
      ConfigError: For a base config that quantizes a weight matmul's
        activation (the frozen base holds weights only).
    """
    rules = config.base_rules()
    exact = []
    for path, m in found.items():
        if m.why_not:
            continue
        res = rules.resolve(path)
        cfg = res.config
        if cfg is None or cfg.fwd.rhs.numerics.is_identity:
            continue
        if not cfg.fwd.lhs.numerics.is_identity:
            raise ConfigError(
                f"base.{res.where}", res.name or "inline",
                "a weight-only config (activations float: nf4, w4g128_asym, "
                "int4_weight_only, nvfp4_weight_only, or fwd.lhs without numerics)",
                why="the frozen base holds quantized weights; its matmuls' "
                "activations stay float, and so do their gradients",
                source=rules.source, layer=path,
            )  # fmt: skip
        # Later uses (fc1#2) first: a rule for fc1 also matches fc1#2.
        exact.append((("#" not in path), Rule(re.escape(path), cfg)))
    ordered = tuple(r for _, r in sorted(exact, key=lambda e: e[0]))
    return rules, QuantConfig(rules=ordered, default=None)


def _in_base(e: ConfigError, rules: QuantConfig, exact: QuantConfig) -> ConfigError:
    """An error about the exact rules, as the base config's (its place in it)."""
    found = re.fullmatch(r"rules\[(\d+)\]\.config(.*)", e.path)
    if found is None:
        return e
    path = exact.rules[int(found.group(1))].pattern.replace("\\", "")
    where = f"base.{rules.resolve(path).where}{found.group(2)}"
    return ConfigError(
        where, e.value, e.allowed, why=e.why, source=rules.source, layer=e.layer
    )


def _frozen_base(params: Any, stored: dict[str, Any]) -> LoraBase:
    fills = {}
    for name, s in stored.items():
        if s.exclusive:
            fills[jax.tree_util.keystr(s.keys)] = (
                tuple(int(n) for n in s.shape),
                np.dtype(s.dtype).name,
                name,
            )

    def leaf(path: Any, x: Any) -> Any:
        found = fills.get(jax.tree_util.keystr(path))
        return x if found is None else jnp.zeros((0,), found[1])

    held = jax.tree_util.tree_map_with_path(leaf, params)
    weights = {name: s.weight for name, s in stored.items()}
    return LoraBase(held, weights, tuple((k, *found) for k, found in fills.items()))


def _merge_check(m: transform._WeightMatmul, index: np.ndarray | None) -> str:
    """Why ``merge`` cannot fold this matmul's weight back, or ``""``."""
    if m.matmul is None:
        return ""
    if not m.exclusive:
        return (
            "its parameter is also read elsewhere (another matmul, a lookup): "
            "merging would change that too"
        )
    size = math.prod(m.matmul.param_shape)
    if index is not None and not (np.unique(index).size == index.size == size):
        return (
            f"the model broadcasts or slices its parameter (shape "
            f"{list(m.matmul.param_shape)}) into the operand "
            f"{list((*m.matmul.layers, *m.matmul.shape))}: an update of the "
            "operand is no update of the parameter"
        )
    return ""


def _init_all(
    config: LoraConfig, layers: list[AdaptedLayer], key: Any, params: Any
) -> dict[str, dict[str, jax.Array]]:
    """Every adapter's ``A`` and ``B`` (zeros), sharded as their parameter.

    ``A`` is drawn on the host (NumPy's PCG64, seeded with the key's bits and
    a hash of the path: nothing to compile, and another rule leaves the
    others' ``A`` as they were).
    """
    found = dict(jax.tree_util.tree_leaves_with_path(params))
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    words = [int(w) for w in np.asarray(key).ravel()]
    out = {}
    for la in layers:
        if la.rank is None:
            continue
        shapes = la.shapes()
        rng = np.random.default_rng([*words, zlib.crc32(la.path.encode())])
        if config.init == "kaiming":
            bound = 1.0 / np.sqrt(la.matmul.k)
            a = rng.uniform(-bound, bound, shapes["a"])
        else:
            a = rng.normal(0.0, 1.0 / la.rank, shapes["a"])
        axes = _adapter_axes(la.matmul)
        param = found.get(la.matmul.keys)
        out[la.path] = {
            "a": like(jnp.asarray(a.astype(np.float32)), param, axes["a"]),
            "b": like(jnp.asarray(np.zeros(shapes["b"], np.float32)), param, axes["b"]),
        }
    return out


def _adapter_axes(m: transform.ObservedMatmul) -> dict[str, tuple[int | None, ...]]:
    """The parameter axis each axis of ``A`` and ``B`` stands for.

    ``A``'s contraction axis is the weight's (``B``'s output axis the
    weight's output axis) where the weight has one and is its parameter as
    it is (no reshape or transpose between them); the rank is replicated.
    """
    lead = len(m.layers)
    same = tuple(m.param_shape) == (*m.layers, *m.shape)
    groups = tuple(lead + a for a in m.batch) if m.grouped else ()
    stack = (*range(lead), *groups) if same else (None,) * (lead + len(groups))

    def one(axes: tuple[int, ...]) -> int | None:
        return lead + axes[0] if same and len(axes) == 1 else None

    return {
        "a": (*stack, one(m.contracting), None),
        "b": (*stack, None, one(m.free)),
    }
