"""Rule-based quantization of an unmodified Flax linen model.

``quantize(model, config)`` returns a :class:`Quantized` linen module that
wraps ``model``. Its methods run the model under
``flax.linen.intercept_methods``: while the model runs, every call of flax's
own ``Dense``, ``DenseGeneral``, ``Conv``, ``Einsum`` and
``MultiHeadDotProductAttention`` ``__call__`` passes through an interceptor
that looks up the layer's module path (``"Block_0/attn/query"``; the two
attention einsums of an attention layer at ``P`` are ``P/qk`` and ``P/pv``)
in the :class:`~qbits.config.QuantConfig` and, for that one call, puts a
quantized function in the layer's own injection field (``dot_general``,
``conv_general_dilated``, the attention's ``*_einsum_cls``), on the clone
linen bound for this ``init``/``apply``. ``nn.Einsum`` has no such field; its
``__call__`` is run with the quantized einsum on the same parameters.

This is not a global patch: nothing in ``jax.lax``, ``jax.numpy`` or flax is
replaced. The interceptor exists only while a :class:`Quantized` module's
method runs, on that thread, and what it changes is part of the traced
function itself. The float model and its quantized version are different
functions to ``jax.jit`` (and different, unequal static arguments), so each
keeps its own compiled code and numbers, whichever is traced first. The
wrapper shares its scope with the model (``nn.share_scope``): the variables
are exactly the float model's, so parameters move freely between the two.

Layers that already carry a function in their injection field (an explicit
``dot_general=qbits.dot_general(...)``) keep it. ``ConvTranspose`` and
``ConvLocal`` (flax calls ``lax.conv_transpose`` and
``lax.conv_general_dilated_local`` directly) stay float and are not listed;
so does a layer subclass whose ``__call__`` replaces flax's, and an
attention layer whose ``attention_fn`` does not accept the einsums.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from qbits._errors import InvalidArgumentError
from qbits.config import LayerTable, QuantConfig, as_quant_config
from qbits.flax._layers import Session
from qbits.numerics import hash_key

__all__ = ["Quantized", "layer_table", "quantize"]

_local = threading.local()  # where layer_table collects the tables


def _report(table: LayerTable, whole: bool) -> None:
    sink = getattr(_local, "sink", None)
    if sink is not None:
        sink.append(table)
    elif whole:  # a method other than __call__ may use only part of the model
        table.warn_unused()


class Quantized(nn.Module):
    """A linen model whose matmuls run quantized, as per-layer rules say.

    Made by :func:`quantize`. Use it like the model: ``init`` and ``apply``
    take the same arguments (``method=`` names or gives a method of the
    wrapped model), and the variables are the model's own. Layers whose
    config rounds stochastically draw a PRNG key from the ``'quant'`` stream:
    pass ``rngs={'quant': key}`` (a new key each step).

    Every traced ``__call__`` checks the configs against the operand shapes
    and warns with :class:`~qbits.config.UnusedRuleWarning` when some rule
    matched no layer (other methods may use part of the model: no warning).

    Notes: wrap the top-level model (a wrapper created inside another
    module's ``init``/``apply`` would nest its variables under its own
    name). Inside ``nn.scan``, list ``'quant'`` in ``split_rngs`` for a key
    per step. With ``capture_intermediates``, the root's ``'__call__'``
    entry holds the output twice (the wrapper's and the model's).

    Attributes:
      model: The float linen model (unmodified).
      config: The per-layer rules.

    Example:
      >>> import flax.linen as nn
      >>> qmodel = qbits.flax.quantize(nn.Dense(4), "int8_fwd")
      >>> x = jnp.ones((2, 8))
      >>> params = nn.Dense(4).init(jax.random.key(0), x)
      >>> jax.jit(qmodel.apply)(params, x).shape
      (2, 4)
    """

    model: nn.Module
    config: QuantConfig

    def setup(self) -> None:
        """Shares the wrapper's scope with the model (identical variables)."""
        nn.share_scope(self, self.model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Calls the model with its matmuls quantized."""
        return self._run("__call__", *args, **kwargs)

    def _run(self, method: str | Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if isinstance(method, str):
            fn = getattr(self.model, method)
        else:
            fn = functools.partial(method, self.model)
        session = Session(self.config, self.has_rng("quant"))
        with nn.intercept_methods(session.intercept):
            out = fn(*args, **kwargs)
        _report(session.table(), whole=method == "__call__")
        return out

    @nn.nowrap
    def apply(self, variables: Any, *args: Any, method: Any = None, **kwargs: Any):
        """``flax.linen.Module.apply``; ``method`` refers to the wrapped model.

        The ``'quant'`` key becomes a :func:`qbits.numerics.hash_key`, so that
        the layers' ``make_rng`` (a ``fold_in`` each) compile to a few integer
        operations instead of a threefry loop per layer.
        """
        if "rngs" in kwargs:
            kwargs["rngs"] = _hashed(kwargs["rngs"])
        return super().apply(variables, *args, method=_method(method), **kwargs)

    @nn.nowrap
    def init_with_output(self, rngs: Any, *args: Any, method: Any = None, **kwargs):
        """``Module.init_with_output``; ``method`` refers to the wrapped model."""
        return super().init_with_output(
            _hashed(rngs), *args, method=_method(method), **kwargs
        )


def _hashed(rngs: Any) -> Any:
    """``rngs`` with its ``'quant'`` key as a hash key (see ``Quantized.apply``)."""
    if isinstance(rngs, Mapping) and rngs.get("quant") is not None:
        return {**rngs, "quant": hash_key(rngs["quant"])}
    return rngs


def _method(method: Any) -> Callable[..., Any] | None:
    """A method of the wrapped model as a method of the wrapper."""
    if method is None or method == "__call__":
        return None
    if not isinstance(method, str):
        if inspect.ismethod(method) and isinstance(method.__self__, nn.Module):
            method = method.__func__
        if not callable(method):
            raise InvalidArgumentError(
                "Quantized.apply",
                "method",
                method,
                "None, a method name or a method of the wrapped model",
            )

    def run(wrapper: Quantized, *args: Any, **kwargs: Any) -> Any:
        return wrapper._run(method, *args, **kwargs)

    return run


def quantize(model: nn.Module, config: Any) -> Quantized:
    """The model with the matmuls of its layers quantized by per-layer rules.

    Every ``nn.Dense``, ``nn.DenseGeneral``, ``nn.Conv`` and ``nn.Einsum``,
    and the two attention einsums of every ``nn.MultiHeadDotProductAttention``
    (``P/qk``: query . key, ``P/pv``: weights . value, for an attention layer
    at path ``P``; its projections are ``DenseGeneral`` layers ``P/query`` and
    so on) gets the config of the first rule whose pattern fully matches its
    module path (``"Block_0/mlp/fc1"``, the names joined by ``/``), else the
    default. The model's code is not changed and nothing is patched globally;
    layers given a function explicitly (``dot_general=``) keep it.

    Args:
      model: An unbound linen module (the top-level model).
      config: A :class:`~qbits.config.QuantConfig`; or a
        :class:`~qbits.DotGeneralConfig` or a preset name for every layer;
        or ``None`` (all float).

    Returns:
      A :class:`Quantized` module whose variables are ``model``'s: parameters
      from ``model.init`` work in its ``apply``, and the other way round.

    Raises:
      InvalidArgumentError: For a model that is not a linen module (or is
        quantized already) or a config of another type. A config that does
        not fit a layer (a tile size that does not divide its contracting
        axis) raises :class:`~qbits.ConfigError` when the model is traced,
        naming e.g. ``rules[1].config.fwd.rhs.granularity.tile_size``; a
        layer that needs a ``'quant'`` key and gets none raises
        :class:`InvalidArgumentError` naming the layer.

    Example:
      >>> import flax.linen as nn
      >>> from qbits.config import QuantConfig, Rule
      >>> class MLP(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x):
      ...         x = nn.relu(nn.Dense(16, name="fc1")(x))
      ...         return nn.Dense(4, name="head")(x)
      >>> config = QuantConfig(rules=(Rule("head", None),), default="int8_fwd")
      >>> qmodel = qbits.flax.quantize(MLP(), config)
      >>> x = jax.random.normal(jax.random.key(0), (2, 8))
      >>> params = MLP().init(jax.random.key(1), x)
      >>> y = jax.jit(qmodel.apply)(params, x)  # the float model's params
      >>> qbits.ops.jaxpr_dot_dtypes(lambda p: qmodel.apply(p, x), params)
      [('int8', 'int8', 'int32'), ('float32', 'float32', 'float32')]
    """
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(
            "qbits.flax.quantize", "model", model, "a flax.linen.Module"
        )
    if isinstance(model, Quantized):
        raise InvalidArgumentError(
            "qbits.flax.quantize",
            "model",
            model,
            "a model that is not quantized yet (pass quantized.model)",
        )
    return Quantized(
        model, as_quant_config("qbits.flax.quantize", config, allow_none=True)
    )


def layer_table(model: nn.Module, config: Any, *args: Any, **kwargs: Any) -> LayerTable:
    """Which config each quantizable matmul of ``model`` gets.

    Traces ``init`` of the quantized model abstractly (``jax.eval_shape``:
    nothing is computed or allocated) on sample inputs, and collects every
    layer it meets. Configs are checked against the operand shapes as in a
    real trace. No :class:`~qbits.config.UnusedRuleWarning` is raised: see
    ``unused_rules`` of the result.

    Args:
      model: An unbound linen module, as for :func:`quantize`.
      config: As for :func:`quantize`.
      *args: Sample inputs for the model's ``__call__``: arrays or
        ``jax.ShapeDtypeStruct`` s (other values are passed as they are).
      **kwargs: Keyword arguments for ``__call__``.

    Returns:
      A :class:`~qbits.config.LayerTable`: one row per layer (path, kind,
      resolved config, whether explicit), and the rules that matched nothing.

    Raises:
      InvalidArgumentError: As for :func:`quantize`.
      ConfigError: For a config that does not fit a layer's operands.

    Example:
      >>> import flax.linen as nn
      >>> from qbits.config import QuantConfig, Rule
      >>> config = QuantConfig(rules=(Rule("query|key", "int8_fwd"),
      ...                             Rule("nowhere", "int8")))
      >>> attn = nn.MultiHeadDotProductAttention(num_heads=2)
      >>> table = qbits.flax.layer_table(attn, config, jnp.ones((1, 4, 8)))
      >>> [(row.path, row.describe()) for row in table.rows]
      [('query', 'int8_fwd'), ('key', 'int8_fwd'), ('value', 'float'),
       ('qk', 'float'), ('pv', 'float'), ('out', 'float')]
      >>> table.unused_message()
      "rules[1] (pattern 'nowhere') matched no layer"
    """
    qmodel = quantize(model, config)
    leaves, treedef = jax.tree.flatten((args, kwargs))
    arrays = [
        i
        for i, x in enumerate(leaves)
        if isinstance(x, jax.Array | np.ndarray | jax.ShapeDtypeStruct)
    ]

    def init(*values: Any) -> Any:
        filled = list(leaves)
        for i, v in zip(arrays, values, strict=True):
            filled[i] = v
        a, kw = jax.tree.unflatten(treedef, filled)
        key = jax.random.key(0)
        return qmodel.init({"params": key, "quant": key}, *a, **kw)

    sink: list[LayerTable] = []
    previous = getattr(_local, "sink", None)
    _local.sink = sink
    try:
        jax.eval_shape(init, *(leaves[i] for i in arrays))
    finally:
        _local.sink = previous
    return sink[-1]
