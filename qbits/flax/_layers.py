"""What :func:`qbits.flax.quantize` does to each kind of linen layer.

One :class:`Session` lives for one call of a quantized model. Its
:meth:`Session.intercept` is a linen method interceptor: it acts only when
the function about to run is flax's own ``__call__`` of a layer it knows
(compared by identity, so a subclass that overrides ``__call__`` is left
alone, and a lifted transform such as ``nn.remat`` is acted on once, at the
layer's own ``__call__`` inside it). It resolves the layer's config from its
module path, records the layer for the table, and runs the layer with a
quantized function in its injection field for the duration of that one call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from qbits._errors import InvalidArgumentError
from qbits.config import (
    CheckedConv,
    CheckedDotGeneral,
    LayerTable,
    QuantConfig,
    show_layer,
)
from qbits.flax._stateful import StatefulConv, StatefulDotGeneral, StatefulEinsum
from qbits.ops import DotGeneralConfig, Einsum, needs_state
from qbits.ops import conv_general_dilated as make_conv
from qbits.ops import dot_general as make_dot_general

__all__ = ["ATTENTION", "Session"]

ATTENTION = "MultiHeadDotProductAttention"


def _raw(method: Callable[..., Any]) -> Callable[..., Any]:
    """The function linen wraps as a module method (what interceptors see)."""
    return getattr(method, "__wrapped__", method)


@contextlib.contextmanager
def _fields(module: nn.Module, **values: Any) -> Iterator[None]:
    """Sets fields of a bound module for one call, and restores them.

    The module is the clone linen bound for this ``init``/``apply``, never the
    user's own object, and linen reads these fields only while the call runs.
    """
    old = {name: getattr(module, name) for name in values}
    try:
        for name, value in values.items():
            object.__setattr__(module, name, value)
        yield
    finally:
        for name, value in old.items():
            object.__setattr__(module, name, value)


def _path(module: nn.Module, suffix: str = "") -> str:
    path = "/".join(str(p) for p in module.path)
    return f"{path}/{suffix}" if path and suffix else path or suffix


class Session:
    """Resolves and records the layers of one call of a quantized model.

    Attributes:
      config: The per-layer rules.
      layers: ``(path, kind)`` of every quantizable layer met, in call order.
      explicit: Paths of layers that keep a function given in the model.
    """

    def __init__(self, config: QuantConfig, has_quant_rng: bool = False):
        self.config = config
        # Whether the quantized model itself got a 'quant' rng: a layer that
        # lacks one then sits in a lifted transform that did not split it.
        self.has_quant_rng = has_quant_rng
        self.layers: list[tuple[str, str]] = []
        self.explicit: set[str] = set()
        self._handlers: dict[Callable[..., Any], Callable[..., Any]] = {
            _raw(nn.Dense.__call__): self._dense,
            _raw(nn.DenseGeneral.__call__): self._dense,
            _raw(nn.Conv.__call__): self._conv,
            _raw(nn.Einsum.__call__): self._einsum,
            _raw(nn.MultiHeadDotProductAttention.__call__): self._attention,
        }

    def intercept(
        self,
        next_fun: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        context: nn.module.InterceptorContext,
    ) -> Any:
        """The linen method interceptor (see ``flax.linen.intercept_methods``)."""
        handler = self._handlers.get(getattr(context.orig_method, "func", None))
        if handler is None:
            return next_fun(*args, **kwargs)
        return handler(context.module, next_fun, args, kwargs)

    def table(self) -> LayerTable:
        """The :class:`~qbits.config.LayerTable` of the layers met so far."""
        return self.config.table(self.layers, explicit=self.explicit)

    def _record(self, path: str, kind: str, explicit: bool) -> None:
        if (path, kind) not in self.layers:  # a shared layer called again
            self.layers.append((path, kind))
        if explicit:
            self.explicit.add(path)

    def _resolve(
        self, module: nn.Module, path: str, kind: str, explicit: bool
    ) -> tuple[DotGeneralConfig, str, jax.Array | None] | None:
        """``(config, where, key)`` of a layer to quantize, or ``None``."""
        self._record(path, kind, explicit)
        if explicit:
            return None
        res = self.config.resolve(path)
        if res.config is None or res.config.is_identity:
            return None
        key = None
        if res.config.needs_key:
            if not module.has_rng("quant"):
                name = f" ({res.name!r})" if res.name else ""
                fix = (
                    "'quant' listed in split_rngs of the nn.scan / nn.vmap "
                    "around the layer (e.g. split_rngs={'params': True, "
                    "'quant': True}): the model got the key, the lifted layer "
                    "did not"
                    if self.has_quant_rng
                    else "a PRNG key: pass rngs={'quant': jax.random.key(...)} "
                    "to apply (and to init, with 'params')"
                )
                raise InvalidArgumentError(
                    "qbits.flax.quantize",
                    "rngs['quant']",
                    None,
                    fix,
                    why=f"layer {show_layer(path)} gets {res.where}{name}, which "
                    "rounds stochastically",
                )
            key = module.make_rng("quant")  # differs per layer and per call
        return res.config, res.where, key

    # Dense and DenseGeneral: the `dot_general` field.
    def _dense(self, module, next_fun, args, kwargs):
        explicit = module.dot_general is not None or module.dot_general_cls is not None
        kind = "DenseGeneral" if isinstance(module, nn.DenseGeneral) else "Dense"
        found = self._resolve(module, _path(module), kind, explicit)
        if found is None:
            return next_fun(*args, **kwargs)
        config, where, key = found
        if needs_state(config):  # a child module holds the delayed scales
            cls = functools.partial(
                StatefulDotGeneral, config, key, where, _path(module)
            )
            with _fields(module, dot_general_cls=cls):
                return next_fun(*args, **kwargs)
        fn = CheckedDotGeneral(make_dot_general(config, key), where, _path(module))
        with _fields(module, dot_general=fn):
            return next_fun(*args, **kwargs)

    # Conv: the `conv_general_dilated` field. ConvLocal (unshared weights)
    # runs `lax.conv_general_dilated_local`, which has no injection point.
    def _conv(self, module, next_fun, args, kwargs):
        if not module.shared_weights:
            return next_fun(*args, **kwargs)
        explicit = (
            module.conv_general_dilated is not None
            or module.conv_general_dilated_cls is not None
        )
        found = self._resolve(module, _path(module), "Conv", explicit)
        if found is None:
            return next_fun(*args, **kwargs)
        config, where, key = found
        if needs_state(config):  # a child module holds the scale state
            cls = functools.partial(StatefulConv, config, key, where, _path(module))
            with _fields(module, conv_general_dilated_cls=cls):
                return next_fun(*args, **kwargs)
        fn = CheckedConv(make_conv(config, key), where, _path(module))
        with _fields(module, conv_general_dilated=fn):
            return next_fun(*args, **kwargs)

    # Einsum calls `jnp.einsum` with no injection point: its `__call__` is run
    # here with the quantized einsum instead, on the same parameters.
    def _einsum(self, module, next_fun, args, kwargs):
        found = self._resolve(module, _path(module), "Einsum", False)
        if found is None:
            return next_fun(*args, **kwargs)
        config, where, key = found
        if needs_state(config):  # a child module holds the scale state
            op = StatefulEinsum(config, key, where, _path(module))
            return _run_einsum(module, op, *args, **kwargs)
        dot = CheckedDotGeneral(make_dot_general(config, key), where, _path(module))
        return _run_einsum(module, Einsum(dot), *args, **kwargs)

    # MultiHeadDotProductAttention: its query/key/value/out DenseGeneral
    # children are layers of their own; its two einsums go in through the
    # `*_einsum_cls` fields.
    def _attention(self, module, next_fun, args, kwargs):
        accepted = inspect.signature(module.attention_fn).parameters
        if not {"qk_attn_weights_einsum", "attn_weights_value_einsum"} <= set(
            accepted
        ):  # a custom attention_fn that cannot take the einsums
            return next_fun(*args, **kwargs)
        explicit = (
            module.qk_attn_weights_einsum_cls is not None
            or module.attn_weights_value_einsum_cls is not None
        )
        if explicit:
            for part in ("qk", "pv"):
                self._record(_path(module, part), f"{ATTENTION}.{part}", True)
            return next_fun(*args, **kwargs)
        values: dict[str, Any] = {
            "qk_attn_weights_einsum_cls": _EinsumFactory(self, module, "qk"),
            "attn_weights_value_einsum_cls": _EinsumFactory(self, module, "pv"),
        }
        if module.precision is not None:
            # flax refuses `precision` beside the einsums; they carry it.
            values["attention_fn"] = _without_precision(module.attention_fn)
        with _fields(module, **values):
            return next_fun(*args, **kwargs)


@dataclasses.dataclass(frozen=True, eq=False)
class _EinsumFactory:
    """An MHA einsum factory: resolves the einsum when the layer asks for it."""

    session: Session
    module: nn.Module
    part: str

    def __call__(self) -> Callable[..., jax.Array]:
        module = self.module
        path = _path(module, self.part)
        found = self.session._resolve(module, path, f"{ATTENTION}.{self.part}", False)
        if found is None:  # what flax does without a factory
            return functools.partial(jnp.einsum, precision=module.precision)
        config, where, key = found
        if needs_state(config):  # a child of the attention layer, named qk/pv
            op: Any = StatefulEinsum(config, key, where, path, name=self.part)
        else:
            op = Einsum(CheckedDotGeneral(make_dot_general(config, key), where, path))
        return functools.partial(op, precision=module.precision)


def _without_precision(attention_fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(attention_fn)  # keeps the signature MHA inspects
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("precision", None)
        return attention_fn(*args, **kwargs)

    return wrapped


def _run_einsum(
    module: nn.Einsum, op: Einsum, inputs: Any, einsum_str: str | None = None
) -> jax.Array:
    """``nn.Einsum.__call__`` (flax 0.12) with ``op`` in place of ``jnp.einsum``."""
    einsum_str = nn.merge_param("einsum_str", module.einsum_str, einsum_str)
    einsum_str = einsum_str.replace(" ", "")
    if "->" not in einsum_str:
        raise ValueError('`einsum_str` equation must be explicit and include "->".')
    if einsum_str.count(",") != 1:
        raise ValueError(
            "`einsum_str` equation must have exactly two operands and "
            "therefore, exactly one comma character, instead of "
            f"{einsum_str.count(',')}"
        )
    kernel = module.param(
        "kernel", module.kernel_init, module.shape, module.param_dtype
    )
    bias = None
    if module.use_bias:
        bias_shape, broadcast_shape = module._get_bias_shape(einsum_str, inputs, kernel)
        bias = module.param("bias", module.bias_init, bias_shape, module.param_dtype)
    inputs, kernel, bias = module.promote_dtype(
        inputs, kernel, bias, dtype=module.dtype
    )
    y = op(
        einsum_str,
        inputs,
        kernel,
        precision=module.precision,
        preferred_element_type=module.preferred_element_type,
    )
    if bias is not None:
        y += jnp.reshape(bias, broadcast_shape)
    return y
