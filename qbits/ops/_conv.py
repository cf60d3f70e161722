"""Quantized ``conv_general_dilated``: forward and both backward convolutions."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qbits._errors import InvalidArgumentError
from qbits._tensor import QTensor
from qbits.ops import _core as core
from qbits.ops import _state as state_lib
from qbits.ops._config import DotGeneralConfig, MatmulConfig, check_config
from qbits.ops._dims import Axes
from qbits.ops._kind import Call, Operand, OpKind
from qbits.ops._op import Op
from qbits.ops._rescale import common_dtypes, dot_operand

__all__ = ["KIND", "ConvContraction", "ConvGeneralDilated", "conv_general_dilated"]

_SIGNATURE = inspect.signature(lax.conv_general_dilated)


@dataclasses.dataclass(frozen=True)
class _Conv:
    """The static arguments of one ``lax.conv_general_dilated`` call."""

    window_strides: tuple[int, ...]
    padding: Any
    lhs_dilation: tuple[int, ...] | None
    rhs_dilation: tuple[int, ...] | None
    dimension_numbers: lax.ConvDimensionNumbers
    feature_group_count: int
    batch_group_count: int
    precision: Any
    preferred_element_type: Any
    out_sharding: Any

    @classmethod
    def create(
        cls, lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...], *args: Any
    ) -> _Conv:
        """The arguments of a call with operands of these shapes, hashable.

        ``args``: those of ``lax.conv_general_dilated`` after the operands.
        """
        (strides, padding, lhs_dilation, rhs_dilation, numbers, features,
         batches, precision, preferred, sharding) = _arguments(*args)  # fmt: skip
        return cls(
            tuple(strides),
            _hashable(padding),
            None if lhs_dilation is None else tuple(lhs_dilation),
            None if rhs_dilation is None else tuple(rhs_dilation),
            lax.conv_dimension_numbers(lhs_shape, rhs_shape, numbers),
            features,
            batches,
            _hashable(precision),
            preferred,
            sharding,
        )

    def __call__(
        self, lhs: jax.Array, rhs: jax.Array, preferred: Any = None
    ) -> jax.Array:
        return lax.conv_general_dilated(
            lhs,
            rhs,
            self.window_strides,
            self.padding,
            self.lhs_dilation,
            self.rhs_dilation,
            self.dimension_numbers,
            self.feature_group_count,
            self.batch_group_count,
            self.precision,
            preferred if preferred is not None else self.preferred_element_type,
            out_sharding=self.out_sharding,
        )

    # The axes each operand contracts over, in each of the three convolutions
    # (the feature axis last: what Tiled(axis=None) tiles).
    @property
    def lhs_contracting(self) -> tuple[int, ...]:  # window and features
        spec = self.dimension_numbers.lhs_spec
        return (*spec[2:], spec[1])

    @property
    def rhs_contracting(self) -> tuple[int, ...]:  # window and input features
        spec = self.dimension_numbers.rhs_spec
        return (*spec[2:], spec[1])

    @property
    def out_contracting_dlhs(self) -> tuple[int, ...]:  # window, output features
        spec = self.dimension_numbers.out_spec
        return (*spec[2:], spec[1])

    @property
    def rhs_contracting_dlhs(self) -> tuple[int, ...]:  # window, output features
        spec = self.dimension_numbers.rhs_spec
        return (*spec[2:], spec[0])

    @property
    def out_contracting_drhs(self) -> tuple[int, ...]:  # batch and positions
        spec = self.dimension_numbers.out_spec
        return (spec[0], *spec[2:])

    @property
    def lhs_contracting_drhs(self) -> tuple[int, ...]:  # batch and positions
        spec = self.dimension_numbers.lhs_spec
        return (spec[0], *spec[2:])


def _hashable(x: Any) -> Any:
    if isinstance(x, list):
        return tuple(_hashable(v) for v in x)
    return x


@dataclasses.dataclass(frozen=True, eq=False)
class ConvGeneralDilated(Op):
    """A drop-in ``jax.lax.conv_general_dilated`` that quantizes.

    Made by :func:`conv_general_dilated`. It holds its ``config`` (the
    forward and the two gradient convolutions) and ``key`` (for stochastic
    rounding, or ``None``); two are equal when those are.

    Example:
      >>> import flax.linen as nn
      >>> conv = qbits.conv_general_dilated(qbits.DotGeneralConfig())
      >>> layer = nn.Conv(4, (3, 3), conv_general_dilated=conv)
      >>> x = jnp.ones((1, 8, 8, 3))
      >>> layer.apply(layer.init(jax.random.key(0), x), x).shape
      (1, 8, 8, 4)
    """

    def __call__(
        self,
        lhs: jax.typing.ArrayLike,
        rhs: jax.typing.ArrayLike,
        window_strides: Any,
        padding: Any,
        lhs_dilation: Any = None,
        rhs_dilation: Any = None,
        dimension_numbers: Any = None,
        feature_group_count: int = 1,
        batch_group_count: int = 1,
        precision: Any = None,
        preferred_element_type: Any = None,
        out_sharding: Any = None,
        *,
        state: dict[str, jax.Array] | None = None,
        diagnostics: dict[str, jax.Array] | None = None,
    ) -> jax.Array:
        """Computes ``lax.conv_general_dilated`` with quantized convolutions.

        ScaledArray operands give a ScaledArray result (:mod:`qbits.scaled`).
        ``state`` holds the scale state of the config's providers
        (:meth:`init_state`); ``diagnostics`` a probe, as for
        :class:`~qbits.ops.DotGeneral`.
        """
        rest = (window_strides, padding, lhs_dilation, rhs_dilation,
                dimension_numbers, feature_group_count, batch_group_count,
                precision, preferred_element_type, out_sharding)  # fmt: skip

        def quantized(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
            c = _contraction(lhs, rhs, *rest)
            return self._run("conv_general_dilated", c, lhs, rhs, state, diagnostics)

        return self._apply(
            lhs, rhs, lambda a, b: lax.conv_general_dilated(a, b, *rest),
            quantized, state, diagnostics,
        )  # fmt: skip

    def init_state(self, lhs: Any, rhs: Any, *args: Any, **kwargs: Any) -> Any:
        """The initial scale state for these operands (see :mod:`qbits.ops._state`).

        Takes the arguments of the call (arrays or ``jax.ShapeDtypeStruct`` s).

        Example:
          >>> conv = qbits.conv_general_dilated(qbits.presets.get("fp8_delayed"))
          >>> x, w = jnp.ones((1, 3, 8, 8)), jnp.ones((4, 3, 3, 3))
          >>> sorted(conv.init_state(x, w, (1, 1), "SAME"))[:2]
          ['grad_amax_history', 'grad_scale']
        """
        rest = _arguments(*args, **kwargs)
        return self._init_state(
            "conv_general_dilated", lambda a, b: _contraction(a, b, *rest), lhs, rhs
        )


def _arguments(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """``lax.conv_general_dilated``'s arguments after the operands, all ten."""
    bound = _SIGNATURE.bind(None, None, *args, **kwargs)
    bound.apply_defaults()
    return tuple(bound.arguments.values())[2:]


def _contraction(lhs: Any, rhs: Any, *args: Any) -> ConvContraction:
    """The convolution of a call (``args``: as :func:`_arguments`)."""
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise InvalidArgumentError(
                "conv_general_dilated",
                f"{name}.dtype",
                x.dtype,
                "a floating-point dtype",
            )
    conv = _Conv.create(lhs.shape, rhs.shape, *args)
    operands = (
        (tuple(lhs.shape), np.dtype(lhs.dtype)),
        (tuple(rhs.shape), np.dtype(rhs.dtype)),
    )
    return ConvContraction(conv, operands)


def conv_general_dilated(
    config: DotGeneralConfig, key: jax.Array | None = None
) -> ConvGeneralDilated:
    """A quantized drop-in for ``jax.lax.conv_general_dilated``.

    The forward convolution quantizes its input and kernel with
    ``config.fwd``; the two gradient convolutions (the transposes that JAX
    derives for a convolution) quantize the output gradient and the other
    operand with ``config.dlhs`` and ``config.drhs``, as in
    :func:`qbits.dot_general`. Scales left to the operation
    (``PerChannel()``) are shared over each operand's contracted axes: per
    example and per output feature in the forward convolution. In real mode
    the forward convolution runs on the stored integers (int8 x int8 ->
    int32) when both operands are integers; the gradient convolutions always
    run in float on the quantized values (the same numbers).

    Args:
      config: The forward convolution and the two gradient convolutions:
        a :class:`~qbits.DotGeneralConfig`, a preset name (``"int8"``) or
        the path of a YAML file holding one config (as
        :func:`qbits.load_config` reads it).
      key: A PRNG key, required when the config rounds stochastically.

    Returns:
      A :class:`ConvGeneralDilated`, usable as ``conv_general_dilated=`` in
      ``flax.linen.Conv`` and ``flax.nnx.Conv``.

    Raises:
      InvalidArgumentError: If the config rounds stochastically and ``key`` is
        ``None``, or ``key`` is not one PRNG key
        (typed, or 2 or 4 uint32 words).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> int8 = qbits.Quantizer(qbits.IntNumerics(bits=8),
      ...                        granularity=qbits.PerChannel())
      >>> mm = qbits.MatmulConfig(lhs=int8, rhs=int8)
      >>> conv = qbits.conv_general_dilated(qbits.DotGeneralConfig(mm, mm, mm))
      >>> x = jax.random.normal(jax.random.key(0), (2, 3, 8, 8))  # NCHW
      >>> w = jax.random.normal(jax.random.key(1), (4, 3, 3, 3))  # OIHW
      >>> conv(x, w, (1, 1), "SAME").shape
      (2, 4, 8, 8)
    """
    config, key = check_config("conv_general_dilated", config, key)
    state_lib.check_providers(config, "conv_general_dilated")
    return ConvGeneralDilated(config, key)


def _factorable(scale: jax.Array, keep: int, what: str) -> None:
    if any(n != 1 for axis, n in enumerate(scale.shape) if axis != keep):
        raise InvalidArgumentError(
            "MatmulConfig",
            "mode",
            "real",
            "'fake' for these scales",
            why=f"real-mode convolutions need the {what} scale shared over all "
            f"axes but axis {keep}; it has shape {scale.shape}",
        )


@dataclasses.dataclass(frozen=True)
class ConvContraction(core.Contraction):
    """A ``lax.conv_general_dilated`` as a contraction of the core.

    Real mode runs the convolution on the stored integers (int8 x int8 ->
    int32) when both operands are integers, with per-example and
    per-output-feature scales applied to the output.
    """

    conv: _Conv
    operands: tuple[tuple[tuple[int, ...], Any], tuple[tuple[int, ...], Any]]

    @property
    def contracting(self) -> tuple[Axes, Axes]:
        """Input features and window, of the input and of the kernel."""
        return self.conv.lhs_contracting, self.conv.rhs_contracting

    def __call__(self, lhs: QTensor, rhs: QTensor, cfg: MatmulConfig) -> jax.Array:
        """The convolution of two quantized operands."""
        conv = self.conv
        shape = lambda qt: jax.ShapeDtypeStruct(qt.shape, jnp.dtype(qt.dtype))  # noqa: E731
        out_dtype = jax.eval_shape(conv, shape(lhs), shape(rhs)).dtype
        if cfg.mode != "real" or not (lhs.is_plain and rhs.is_plain):
            return conv(lhs.dequant(), rhs.dequant()).astype(out_dtype)
        dn = conv.dimension_numbers
        lhs_keep = dn.lhs_spec[0] if conv.batch_group_count == 1 else -1
        _factorable(lhs.scale, lhs_keep, "input")
        _factorable(rhs.scale, dn.rhs_spec[0], "kernel")
        a, b, acc = common_dtypes(dot_operand(lhs), dot_operand(rhs), cfg.accumulator)
        out = conv(a, b, acc).astype(jnp.float32)
        # Per-example and per-output-feature scales onto the output's axes.
        for scale, axis in ((lhs.scale, dn.out_spec[0]), (rhs.scale, dn.out_spec[1])):
            s = scale.reshape(-1)
            shape_ = [1] * out.ndim
            if s.size > 1:
                shape_[axis] = s.size
            out = out * s.reshape(shape_)
        return out.astype(out_dtype)

    def plain(self, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        """``lax.conv_general_dilated`` itself."""
        return self.conv(lhs, rhs)

    def gradient(self, side: str) -> _ConvTranspose:
        """The transposed convolution that gives the cotangent of ``side``."""
        conv = dataclasses.replace(self.conv, out_sharding=None)
        return _ConvTranspose(conv, side, self.operands[0 if side == "lhs" else 1])


@dataclasses.dataclass(frozen=True)
class _ConvTranspose(core.Contraction):
    """A gradient convolution: the transpose of the forward's linear map.

    It runs in float on the quantized values (the dequantized operands), as
    JAX transposes a convolution; the numbers are those of real mode.
    Operand shapes are taken from the call.
    """

    conv: _Conv
    side: str
    primal: tuple[tuple[int, ...], Any]  # shape and dtype of the operand

    @property
    def contracting(self) -> tuple[Axes, Axes]:
        """Output features and window (dlhs), or batch and positions (drhs)."""
        if self.side == "lhs":
            return self.conv.out_contracting_dlhs, self.conv.rhs_contracting_dlhs
        return self.conv.out_contracting_drhs, self.conv.lhs_contracting_drhs

    def __call__(self, g: QTensor, other: QTensor, cfg: MatmulConfig) -> jax.Array:
        """The gradient from the quantized output gradient and other operand."""
        return self.plain(g.dequant(), other.dequant())

    def plain(self, g: jax.Array, other: jax.Array) -> jax.Array:
        """JAX's transpose of the convolution, applied to ``g``."""
        conv = self.conv
        aval = jax.ShapeDtypeStruct(self.primal[0], other.dtype)
        if self.side == "lhs":
            (out,) = jax.linear_transpose(lambda a: conv(a, other), aval)(g)
        else:
            (out,) = jax.linear_transpose(lambda b: conv(other, b), aval)(g)
        return out

    def gradient(self, side: str) -> core.Contraction:
        """Not needed: the core never differentiates a gradient."""
        raise NotImplementedError


class _ConvKind(OpKind):
    """``conv_general_dilated``: the op kind of :func:`conv_general_dilated`."""

    name = "conv_general_dilated"
    primitives = ("conv_general_dilated",)
    short = "conv"
    limited = "a convolution"
    factory = staticmethod(conv_general_dilated)

    def call(self, params: Any, operands: list[Any]) -> Call:
        """The eleven positional arguments of ``lax.conv_general_dilated``."""
        p = params
        return Call((
            operands[0], operands[1], p["window_strides"], p["padding"],
            p["lhs_dilation"], p["rhs_dilation"], p["dimension_numbers"],
            p["feature_group_count"], p["batch_group_count"], p.get("precision"),
            p.get("preferred_element_type"),
        ))  # fmt: skip

    def operands(self, call: Call, out: tuple[int, ...]) -> tuple[Operand, ...]:
        """As :class:`ConvContraction` and its gradients contract them."""
        lhs, rhs = (tuple(x.shape) for x in call.args[:2])
        conv = _Conv.create(lhs, rhs, *call.args[2:])
        c = ConvContraction(conv, ((lhs, None), (rhs, None)))
        dlhs, drhs = c.gradient("lhs").contracting, c.gradient("rhs").contracting
        out = tuple(out)
        return (
            ("fwd", "lhs", lhs, c.contracting[0]),
            ("fwd", "rhs", rhs, c.contracting[1]),
            ("dlhs", "lhs", out, dlhs[0]),
            ("dlhs", "rhs", rhs, dlhs[1]),
            ("drhs", "lhs", out, drhs[0]),
            ("drhs", "rhs", lhs, drhs[1]),
        )


#: The ``conv_general_dilated`` op kind.
KIND = _ConvKind()
