"""Quantized ``conv_general_dilated``: forward and both backward convolutions."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from qbits.context import Context
from qbits.errors import InvalidArgumentError
from qbits.ops.config import DotGeneralConfig, MatmulConfig, check_config
from qbits.ops.dot_general import _keys
from qbits.ops.matmul import common_dtypes, dot_operand
from qbits.scaled import is_scaled, scalify
from qbits.tensor import QTensor

__all__ = ["ConvGeneralDilated", "conv_general_dilated"]


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

    # The axes each operand contracts over, in each of the three convolutions.
    @property
    def lhs_contracting(self) -> tuple[int, ...]:  # features and window
        spec = self.dimension_numbers.lhs_spec
        return (spec[1], *spec[2:])

    @property
    def rhs_contracting(self) -> tuple[int, ...]:  # input features and window
        spec = self.dimension_numbers.rhs_spec
        return (spec[1], *spec[2:])

    @property
    def out_contracting_dlhs(self) -> tuple[int, ...]:  # output features, window
        spec = self.dimension_numbers.out_spec
        return (spec[1], *spec[2:])

    @property
    def rhs_contracting_dlhs(self) -> tuple[int, ...]:  # output features, window
        spec = self.dimension_numbers.rhs_spec
        return (spec[0], *spec[2:])

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
class ConvGeneralDilated:
    """A drop-in ``jax.lax.conv_general_dilated`` that quantizes.

    Made by :func:`conv_general_dilated`.

    Attributes:
      config: The forward convolution and the two gradient convolutions.
      key: PRNG key for stochastic rounding, or ``None``.

    Example:
      >>> import flax.linen as nn
      >>> conv = qbits.conv_general_dilated(qbits.DotGeneralConfig())
      >>> layer = nn.Conv(4, (3, 3), conv_general_dilated=conv)
      >>> x = jnp.ones((1, 8, 8, 3))
      >>> layer.apply(layer.init(jax.random.key(0), x), x).shape
      (1, 8, 8, 4)
    """

    config: DotGeneralConfig
    key: jax.Array | None = None

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
    ) -> jax.Array:
        """Computes ``lax.conv_general_dilated`` with quantized convolutions.

        ScaledArray operands give a ScaledArray result (:mod:`qbits.scaled`).
        """
        rest = (
            window_strides,
            padding,
            lhs_dilation,
            rhs_dilation,
            dimension_numbers,
            feature_group_count,
            batch_group_count,
            precision,
            preferred_element_type,
            out_sharding,
        )
        if is_scaled(lhs) or is_scaled(rhs):
            return scalify(lambda a, b: self(a, b, *rest))(lhs, rhs)
        lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
        if self.config.is_identity:
            return lax.conv_general_dilated(lhs, rhs, *rest)
        for name, x in (("lhs", lhs), ("rhs", rhs)):
            if not jnp.issubdtype(x.dtype, jnp.floating):
                raise InvalidArgumentError(
                    "conv_general_dilated",
                    f"{name}.dtype",
                    x.dtype,
                    "a floating-point dtype",
                )
        conv = _Conv(
            tuple(window_strides),
            _hashable(padding),
            None if lhs_dilation is None else tuple(lhs_dilation),
            None if rhs_dilation is None else tuple(rhs_dilation),
            lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers),
            feature_group_count,
            batch_group_count,
            _hashable(precision),
            preferred_element_type,
            out_sharding,
        )
        return _quantized_conv(self.config, conv, lhs, rhs, self.key)


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
      config: The forward convolution and the two gradient convolutions.
      key: A PRNG key, required when the config rounds stochastically.

    Returns:
      A :class:`ConvGeneralDilated`, usable as ``conv_general_dilated=`` in
      ``flax.linen.Conv`` and ``flax.nnx.Conv``.

    Raises:
      InvalidArgumentError: If the config rounds stochastically and ``key`` is
        ``None``.

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
    check_config("conv_general_dilated", config, key)
    return ConvGeneralDilated(config, key)


def _quantize(
    cfg: MatmulConfig,
    side: str,
    x: jax.Array,
    contracting: tuple[int, ...],
    key: jax.Array | None,
    store: bool,
) -> tuple[QTensor, jax.tree_util.Partial]:
    quantizer = getattr(cfg, side)
    store = store and quantizer.numerics.get_dtype() is not None
    return quantizer.quant_vjp(
        x, Context(key), store=store, contracting_axes=contracting
    )


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


def _forward(
    cfg: MatmulConfig, conv: _Conv, lhs: jax.Array, rhs: jax.Array, keys: Any
) -> tuple[jax.Array, Any, Any]:
    out_dtype = jax.eval_shape(conv, lhs, rhs).dtype
    real = cfg.mode == "real"
    lq, lgrad = _quantize(cfg, "lhs", lhs, conv.lhs_contracting, keys[0], real)
    rq, rgrad = _quantize(cfg, "rhs", rhs, conv.rhs_contracting, keys[1], real)
    if not real:
        return conv(lq.dequant(), rq.dequant()).astype(out_dtype), lgrad, rgrad
    dn = conv.dimension_numbers
    lhs_keep = dn.lhs_spec[0] if conv.batch_group_count == 1 else -1
    _factorable(lq.scale, lhs_keep, "input")
    _factorable(rq.scale, dn.rhs_spec[0], "kernel")
    a, b, acc = common_dtypes(dot_operand(lq), dot_operand(rq), cfg.accumulator)
    out = conv(a, b, acc).astype(jnp.float32)
    # Per-example and per-output-feature scales onto the output's axes.
    shape = [1] * out.ndim
    sl = lq.scale.reshape(-1)
    if sl.size > 1:
        shape[dn.out_spec[0]] = sl.size
    out = out * sl.reshape(shape)
    shape = [1] * out.ndim
    sr = rq.scale.reshape(-1)
    if sr.size > 1:
        shape[dn.out_spec[1]] = sr.size
    out = out * sr.reshape(shape)
    return out.astype(out_dtype), lgrad, rgrad


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _quantized_conv(
    config: DotGeneralConfig, conv: _Conv, lhs: jax.Array, rhs: jax.Array, key: Any
) -> jax.Array:
    out, _ = _fwd(config, conv, lhs, rhs, key)
    return out


def _fwd(
    config: DotGeneralConfig, conv: _Conv, lhs: jax.Array, rhs: jax.Array, key: Any
) -> tuple[jax.Array, tuple[Any, ...]]:
    out, lgrad, rgrad = _forward(config.fwd, conv, lhs, rhs, _keys(key, 0, 1))
    return out, (lhs, rhs, lgrad, rgrad, key)


def _bwd(
    config: DotGeneralConfig, conv: _Conv, residuals: tuple[Any, ...], g: jax.Array
) -> tuple[jax.Array, jax.Array, None]:
    lhs, rhs, lgrad, rgrad, key = residuals
    # The gradient convolutions are the transposes of the forward's linear
    # maps, applied to the operands as each backward config quantizes them.
    conv = dataclasses.replace(conv, out_sharding=None)
    gk, rk = _keys(key, 2, 3)
    g_l, _ = _quantize(config.dlhs, "lhs", g, conv.out_contracting_dlhs, gk, False)
    r_l, _ = _quantize(config.dlhs, "rhs", rhs, conv.rhs_contracting_dlhs, rk, False)
    (dl,) = jax.linear_transpose(lambda a: conv(a, r_l.dequant()), lhs)(g_l.dequant())
    gk, lk = _keys(key, 4, 5)
    g_r, _ = _quantize(config.drhs, "lhs", g, conv.out_contracting_drhs, gk, False)
    l_r, _ = _quantize(config.drhs, "rhs", lhs, conv.lhs_contracting_drhs, lk, False)
    (dr,) = jax.linear_transpose(lambda b: conv(l_r.dequant(), b), rhs)(g_r.dequant())
    return lgrad(dl.astype(lhs.dtype)), rgrad(dr.astype(rhs.dtype)), None


_quantized_conv.defvjp(_fwd, _bwd)
