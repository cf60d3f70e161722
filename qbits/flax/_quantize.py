"""Rule-based quantization of an unmodified linen model, through the engine.

``quantize(model, config)`` returns a :class:`Quantized`: the model's
``init`` and ``apply`` with every matmul the model runs quantized by
:func:`qbits.quantize`, the jaxpr transformation. ``apply`` is literally
``qbits.quantize(model.apply, config)`` with linen's conventions around
it: the PRNG key for stochastic rounding comes from ``rngs["quant"]``, and
the scale state of delayed scales lives in the variable collection
:data:`~qbits.flax.STATE` (``{matmul path: {entry: array}}``, as
:func:`qbits.init_state` makes it), whose gradient is the new state
(:class:`~qbits.flax.TrainState` writes it back); learned step sizes are
trained, so they are parameters: ``params[`` :data:`~qbits.flax.LEARNED`
``][matmul path]``. So every matmul the
model runs is reached however it is written (Flax layers, custom layers,
raw ``jnp.einsum`` and ``@``, nested ``.apply`` calls, tied heads, scanned
and rematerialised blocks, a submodule of any name), paths and errors are
those of :func:`qbits.layer_table`, and the variables are exactly the float
model's plus the state collection.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax.core import unfreeze
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT

from qbits import transform
from qbits._errors import InvalidArgumentError, check_mapping
from qbits.config import LayerTable, QuantConfig, _as_quant_config

__all__ = ["LEARNED", "STATE", "Quantized", "layer_table", "quantize"]

STATE = OVERWRITE_WITH_GRADIENT
#: The entry of ``params`` holding learned scale state (LSQ step sizes).
LEARNED = "qbits"
_KEY = "quant"
_CALLER = transform._Caller(
    "qbits.flax.quantize",
    key="rngs['quant']",
    state=f"variables[{STATE!r}]",
    state_fix="Quantized.init makes it",
)


def _split_rngs(rngs: Any) -> tuple[Any, Any]:
    """``(quant key, the other rngs)`` of linen's ``rngs`` argument."""
    if rngs is None:
        return None, None
    if not isinstance(rngs, Mapping):  # one key: linen's 'params' stream
        return None, rngs
    rest = {k: v for k, v in rngs.items() if k != _KEY}
    return rngs.get(_KEY), rest or None


@dataclasses.dataclass(frozen=True, eq=False)
class Quantized:
    """A linen model whose matmuls run quantized, as per-layer rules say.

    Made by :func:`qbits.flax.quantize`. ``init`` and ``apply`` take the
    model's own arguments (``method=``, ``rngs=``, ``mutable=`` as in linen);
    the variables are the float model's, plus the collection
    :data:`~qbits.flax.STATE` when some matmul's config keeps scale state.
    Configs that round stochastically draw from ``rngs={'quant': key}``
    (a new key each step). Every traced ``__call__`` warns with
    :class:`~qbits.config.UnusedRuleWarning` when a rule matched no matmul,
    and with a ``UserWarning`` when a config that quantizes something finds
    nothing to quantize (other methods may run part of the model: no
    warning).

    Attributes:
      model: The float linen model (unmodified).
      config: The per-layer rules.

    Example:
      >>> import flax.linen as nn
      >>> qmodel = qbits.flax.quantize(nn.Dense(4), "int8_fwd")
      >>> x = jnp.ones((2, 8))
      >>> params = qmodel.init(jax.random.key(0), x)  # nn.Dense(4)'s params
      >>> jax.jit(qmodel.apply)(params, x).shape
      (2, 4)
    """

    model: nn.Module
    config: QuantConfig

    def _fn(self, method: Any, mutable: Any) -> Callable[..., Any]:
        """``model.apply`` as a function of ``(variables, rngs, *args)``."""

        def apply(variables: Any, rngs: Any, *args: Any, **kwargs: Any) -> Any:
            return self.model.apply(
                variables, *args, rngs=rngs, method=method, mutable=mutable, **kwargs
            )

        return apply

    def init(
        self, rngs: Any, *args: Any, method: Any = None, **kwargs: Any
    ) -> dict[str, Any]:
        """The variables: ``model.init``'s, plus the scale state if any.

        The scale state (:data:`~qbits.flax.STATE`) is that of
        :func:`qbits.init_state`, from a run of the model on ``args``
        (learned step sizes start from these operands).

        Args:
          rngs: As for ``flax.linen.Module.init`` (a key, or a dict of keys;
            a ``'quant'`` key is used by nothing here).
          *args: The model's inputs.
          method: As for ``init``.
          **kwargs: The model's keyword arguments.

        Returns:
          The variables, a dict of collections.

        Raises:
          ConfigError: For a config that does not fit a matmul.
        """
        _, rest = _split_rngs(rngs)
        variables = unfreeze(self.model.init(rest, *args, method=method, **kwargs))
        if not any(c.needs_state for c in self.config.all_configs()):
            return variables
        streams = rest if isinstance(rest, Mapping) else {"params": rest}
        fn = self._fn(method, False)
        call = (fn, self.config, variables, streams, *args)
        state = transform._init_state(_CALLER, *call, **kwargs)
        # The configs the matmuls run (a matmul of two activations adapts
        # its rule's config): which state entries are trained.
        again = dataclasses.replace(_CALLER, whole=False)  # warns once
        configs = transform._layer_table(again, *call, **kwargs).configs()
        for path, entries in state.items():
            kinds = configs[path].state_kinds()
            for name, value in entries.items():
                if kinds[name] == "trained":
                    collection = variables.setdefault("params", {})
                    place = collection.setdefault(LEARNED, {})
                else:
                    place = variables.setdefault(STATE, {})
                place.setdefault(path, {})[name] = value
        return variables

    def apply(
        self,
        variables: Any,
        *args: Any,
        rngs: Any = None,
        method: Any = None,
        mutable: Any = False,
        **kwargs: Any,
    ) -> Any:
        """``model.apply`` with its matmuls quantized.

        Args:
          variables: The variables (``init``'s, or the float model's).
          *args: The model's inputs.
          rngs: As for ``apply``; ``rngs['quant']`` is the key of stochastic
            rounding (required when a config rounds stochastically).
          method: A method name or a method of the model, as in ``apply``.
          mutable: As in ``apply``.
          **kwargs: The model's keyword arguments.

        Returns:
          What ``model.apply`` returns.

        Raises:
          InvalidArgumentError: For a missing ``'quant'`` key or scale state.
          ConfigError: For a config that does not fit a matmul, naming the
            rule (and file) and the matmul.
        """
        key, rest = _split_rngs(rngs)
        variables, state = _variables(variables)
        whole = method is None or method == "__call__"
        caller = dataclasses.replace(
            _CALLER,
            whole=whole,
            # what the function is made of: its program is traced once
            identity=(self, method, _hashable(mutable)),
        )
        run = transform._quantize(
            caller, self._fn(method, mutable), self.config, key, state=state
        )
        return run(variables, rest, *args, **kwargs)


def _hashable(mutable: Any) -> Any:
    """``mutable`` as a hashable value (a list of collections as a tuple)."""
    return tuple(mutable) if isinstance(mutable, list) else mutable


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | jax.ShapeDtypeStruct)


def _variables(variables: Any) -> tuple[dict[str, Any], Any]:
    """The model's own variables, and the scale state (``None`` without)."""
    allowed = "the model's variables, a dict of collections (Quantized.init)"
    check_mapping(_CALLER.owner, "variables", variables, allowed)
    variables = dict(variables)
    state: dict[str, dict[str, Any]] = {}
    for path, entries in dict(variables.pop(STATE, {})).items():
        state.setdefault(path, {}).update(entries)
    params = variables.get("params")
    if isinstance(params, Mapping) and LEARNED in params:
        params = dict(params)
        for path, entries in dict(params.pop(LEARNED)).items():
            state.setdefault(path, {}).update(entries)
        variables["params"] = params
    return variables, state or None


def quantize(model: nn.Module, config: Any) -> Quantized:
    """The model with every matmul it runs quantized by per-layer rules.

    Every matmul ``model.apply`` runs (see :func:`qbits.quantize`: Flax
    layers, custom layers, raw einsums and ``@``, nested ``apply`` calls,
    scanned and rematerialised blocks) gets the config of the first rule
    whose pattern fully matches its path (``"Block_0/mlp/fc1"``;
    :func:`qbits.flax.layer_table` lists them), else the default. The
    model's code is not changed and nothing is patched globally.

    Args:
      model: An unbound linen module (the top-level model).
      config: A :class:`~qbits.QuantConfig`, a
        :class:`~qbits.DotGeneralConfig`, a preset name, the path of a YAML
        file, or ``None`` (all float).

    Returns:
      A :class:`Quantized`: ``init`` and ``apply`` as the model's.

    Raises:
      InvalidArgumentError: For a model that is not a linen module (or is
        quantized already) or a config of another kind.

    Example:
      >>> import flax.linen as nn
      >>> class MLP(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x):
      ...         h = nn.relu(nn.Dense(16, name="fc1")(x))
      ...         w = self.param("head", nn.initializers.normal(), (16, 4))
      ...         return h @ w  # not a Dense: quantized all the same
      >>> config = qbits.QuantConfig(rules=(qbits.Rule("head", None),),
      ...                            default="int8_fwd")
      >>> qmodel = qbits.flax.quantize(MLP(), config)
      >>> x = jax.random.normal(jax.random.key(0), (2, 8))
      >>> params = qmodel.init(jax.random.key(1), x)
      >>> import qbits.hlo
      >>> qbits.hlo.dot_dtypes(lambda p: qmodel.apply(p, x), params, stage="jaxpr")
      [('int8', 'int8', 'int32'), ('float32', 'float32', 'float32')]
    """
    if isinstance(model, Quantized):
        raise InvalidArgumentError(
            _CALLER.owner,
            "model",
            model,
            "a model that is not quantized yet (pass quantized.model)",
        )
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(_CALLER.owner, "model", model, "a flax.linen.Module")
    return Quantized(model, _as_quant_config(_CALLER.owner, config, allow_none=True))


def layer_table(
    model: nn.Module, config: Any, *args: Any, method: Any = None, **kwargs: Any
) -> LayerTable:
    """Every matmul the linen model runs on these inputs, and its config.

    The model is initialised abstractly (``jax.eval_shape``: nothing is
    computed) and its ``apply`` traced, as :func:`qbits.layer_table`
    traces a function; rows, paths and unused rules are the same as there.

    Args:
      model: An unbound linen module (or a :class:`Quantized`: its model).
      config: As for :func:`qbits.flax.quantize`.
      *args: Sample inputs: arrays or ``jax.ShapeDtypeStruct`` s.
      method: The method to trace, as in ``apply``.
      **kwargs: Keyword arguments of the method.

    Returns:
      A :class:`~qbits.config.LayerTable`.

    Raises:
      InvalidArgumentError: For inputs the model's method does not take,
        naming them and the call to make; for the model's variables given
        as an input (``qbits.layer_table(model.apply, config, variables,
        x)`` takes them; this function makes them).

    Example:
      >>> import flax.linen as nn
      >>> attn = nn.MultiHeadDotProductAttention(num_heads=2)
      >>> table = qbits.flax.layer_table(attn, "int8_fwd", jnp.ones((1, 4, 8)))
      >>> [row.path for row in table.rows]
      ['query', 'key', 'value', 'qk', 'pv', 'out']
    """
    if isinstance(model, Quantized):
        model = model.model
    caller = dataclasses.replace(
        _CALLER, owner="qbits.flax.layer_table", whole=method in (None, "__call__")
    )
    qmodel = quantize(model, config)
    call = "qbits.flax.layer_table(model, config, {inputs})"
    variables_given = bool(args) and _are_variables(args[0])
    try:
        if method is None or isinstance(method, str):
            bound = getattr(model, method or "__call__")
            caller.check_inputs(bound, args, kwargs, call)
        variables = _abstract_variables(model, method, args, kwargs)
    except Exception as e:
        if not variables_given:
            raise
        raise InvalidArgumentError(
            caller.owner,
            "args[0]",
            f"the model's variables (collections {sorted(args[0])})",
            "the model's sample inputs only: qbits.flax.layer_table(model, "
            "config, x), which makes the variables (qbits.layer_table("
            "model.apply, config, variables, x) takes them)",
            why=f"the model fails on them: {type(e).__name__}",
        ) from e
    return transform._layer_table(
        caller,
        qmodel._fn(method, False),
        qmodel.config,
        variables,
        None,
        *args,
        **kwargs,
    )


def _are_variables(value: Any) -> bool:
    """Whether ``value`` looks like a linen model's variables (``{'params': ...}``)."""
    return (
        isinstance(value, Mapping)
        and "params" in value
        and all(isinstance(c, Mapping) for c in value.values())
    )


def _abstract_variables(model: nn.Module, method: Any, args: Any, kwargs: Any) -> Any:
    """The shapes of ``model.init``'s variables on these inputs (nothing computed)."""
    leaves, treedef = jax.tree.flatten((args, kwargs))
    arrays = [i for i, x in enumerate(leaves) if _is_array(x)]

    def init(*values: Any) -> Any:
        filled = list(leaves)
        for i, v in zip(arrays, values, strict=True):
            filled[i] = v
        a, kw = jax.tree.unflatten(treedef, filled)
        return unfreeze(model.init(jax.random.key(0), *a, method=method, **kw))

    return jax.eval_shape(init, *(leaves[i] for i in arrays))
