"""Quantized ``dot_general``: forward and both backward matmuls."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from qbits.calibration import DelayedScaling, LearnedScale
from qbits.errors import InvalidArgumentError
from qbits.ops.config import IDENTITY, DotGeneralConfig, MatmulConfig, check_config
from qbits.ops.dims import Dims
from qbits.ops.matmul import matmul, quantize
from qbits.scaled import is_scaled, scalify
from qbits.tensor import QTensor

__all__ = ["DotGeneral", "dot_general"]

# Key streams of the six quantized operands.
_FWD_LHS, _FWD_RHS, _DLHS_LHS, _DLHS_RHS, _DRHS_LHS, _DRHS_RHS = range(6)


def _keys(key: jax.Array | None, *streams: int) -> tuple[jax.Array | None, ...]:
    if key is None:
        return (None,) * len(streams)
    return tuple(jax.random.fold_in(key, s) for s in streams)


@dataclasses.dataclass(frozen=True, eq=False)
class DotGeneral:
    """A drop-in ``jax.lax.dot_general`` that quantizes as its config says.

    Made by :func:`dot_general`; call it exactly like ``lax.dot_general``.

    Attributes:
      config: The three matmuls.
      key: PRNG key for stochastic rounding, or ``None``.

    Example:
      >>> import flax.linen as nn
      >>> dg = qbits.dot_general(qbits.DotGeneralConfig())
      >>> layer = nn.Dense(4, dot_general=dg)
      >>> isinstance(layer.dot_general, qbits.DotGeneral)
      True
    """

    config: DotGeneralConfig
    key: jax.Array | None = None

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, DotGeneral)
            and other.config == self.config
            and other.key is self.key
        )

    def __hash__(self) -> int:
        return hash((self.config, id(self.key)))

    def __call__(
        self,
        lhs: jax.typing.ArrayLike,
        rhs: jax.typing.ArrayLike,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
        *,
        out_sharding: Any = None,
    ) -> jax.Array:
        """Computes ``lax.dot_general(lhs, rhs, ...)`` with quantized matmuls.

        A :class:`~qbits.scaled.ScaledArray` operand gives a ScaledArray
        result (the quantization runs on its data; see :mod:`qbits.scaled`).
        """
        if is_scaled(lhs) or is_scaled(rhs):
            return scalify(
                lambda a, b: self(
                    a,
                    b,
                    dimension_numbers,
                    precision,
                    preferred_element_type,
                    out_sharding=out_sharding,
                )
            )(lhs, rhs)
        lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
        config = self.config
        if config.is_identity:
            return lax.dot_general(
                lhs,
                rhs,
                dimension_numbers,
                precision,
                preferred_element_type,
                out_sharding=out_sharding,
            )
        dims = Dims.create(dimension_numbers, lhs.ndim, rhs.ndim)
        # Let lax check shapes and dtypes, with its own messages.
        jax.eval_shape(
            functools.partial(lax.dot_general, dimension_numbers=dims.lax()),
            jax.ShapeDtypeStruct(lhs.shape, lhs.dtype),
            jax.ShapeDtypeStruct(rhs.shape, rhs.dtype),
        )
        for name, x in (("lhs", lhs), ("rhs", rhs)):
            if not jnp.issubdtype(x.dtype, jnp.floating):
                raise InvalidArgumentError(
                    "dot_general", f"{name}.dtype", x.dtype, "a floating-point dtype"
                )
        return _quantized_dot(
            config,
            dims,
            _hashable(precision),
            preferred_element_type,
            out_sharding,
            lhs,
            rhs,
            self.key,
        )


def _hashable(precision: Any) -> Any:
    if isinstance(precision, list):
        return tuple(precision)
    return precision


def dot_general(config: DotGeneralConfig, key: jax.Array | None = None) -> DotGeneral:
    """A quantized drop-in for ``jax.lax.dot_general``.

    The returned function has exactly the signature of ``lax.dot_general``
    (``precision`` may be positional, ``out_sharding`` is keyword-only), takes
    any dimension numbers, and honours ``precision`` and
    ``preferred_element_type``. Its gradient runs ``config.dlhs`` and
    ``config.drhs``, each quantized as configured, through a custom VJP; a
    numerics' gradient (straight-through, or masked with ``clip_gradient``)
    applies on top. A config that quantizes nothing is ``lax.dot_general``
    itself.

    Args:
      config: The forward matmul and the two gradient matmuls.
      key: A PRNG key, required when any operand rounds stochastically.
        The six operands draw from ``fold_in(key, i)``, i = 0..5. Pass a new
        key each step (and per layer) for independent noise.

    Returns:
      A :class:`DotGeneral`, usable as ``dot_general=`` in ``flax.linen.Dense``
      and ``flax.nnx.Linear``, and as ``jnp.einsum(..., _dot_general=...)``.

    Raises:
      InvalidArgumentError: If the config rounds stochastically and ``key`` is
        ``None``: at once, rather than inside the backward pass.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> int8 = qbits.Quantizer(qbits.IntNumerics(bits=8))
      >>> mm = qbits.MatmulConfig(lhs=int8, rhs=int8)
      >>> dg = qbits.dot_general(qbits.DotGeneralConfig(fwd=mm, dlhs=mm, drhs=mm))
      >>> x = jax.random.normal(jax.random.key(0), (4, 16))
      >>> w = jax.random.normal(jax.random.key(1), (16, 8))
      >>> y = dg(x, w, (((1,), (0,)), ((), ())))
      >>> bool(jnp.allclose(y, x @ w, rtol=0.05, atol=0.1))
      True
      >>> gx, gw = jax.grad(lambda x, w: dg(x, w, (((1,), (0,)), ((), ()))).sum(),
      ...                   argnums=(0, 1))(x, w)
    """
    check_config("dot_general", config, key)
    for m_name in ("fwd", "dlhs", "drhs"):
        for side in ("lhs", "rhs"):
            cal = getattr(getattr(config, m_name), side).calibration
            if isinstance(cal, DelayedScaling | LearnedScale):
                raise InvalidArgumentError(
                    "dot_general",
                    f"config.{m_name}.{side}.calibration",
                    cal,
                    "a stateless calibration; for DelayedScaling and "
                    "LearnedScale use "
                    "qbits.ops.stateful_dot_general, qbits.flax.quantize or "
                    "qbits.nnx.quantize, which keep its state",
                )
    return DotGeneral(config, key)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _quantized_dot(
    config: DotGeneralConfig,
    dims: Dims,
    precision: Any,
    preferred_element_type: Any,
    out_sharding: Any,
    lhs: jax.Array,
    rhs: jax.Array,
    key: jax.Array | None,
) -> jax.Array:
    out, _ = _fwd(
        config, dims, precision, preferred_element_type, out_sharding, lhs, rhs, key
    )
    return out


def _fwd(
    config: DotGeneralConfig,
    dims: Dims,
    precision: Any,
    preferred_element_type: Any,
    out_sharding: Any,
    lhs: jax.Array,
    rhs: jax.Array,
    key: jax.Array | None,
) -> tuple[jax.Array, tuple[Any, ...]]:
    out, lhs_q, rhs_q = matmul(
        lhs,
        rhs,
        dims,
        config.fwd,
        _keys(key, _FWD_LHS, _FWD_RHS),
        precision=precision,
        preferred_element_type=preferred_element_type,
        out_sharding=out_sharding,
    )
    # Keep what the backward matmuls read of the forward operands: quantized
    # already, as each will use it (stored values are a quarter of float32's
    # memory, and quantizing next to the forward pass reads the operand while
    # it is still in cache), or the forward's own quantized operand when a
    # backward matmul reuses it.
    residuals = (
        _for_backward(
            config.drhs, lhs, lhs_q.qtensor, dims.grad_rhs()[0], key, _DRHS_RHS
        ),
        _for_backward(
            config.dlhs, rhs, rhs_q.qtensor, dims.grad_lhs()[0], key, _DLHS_RHS
        ),
        lhs_q.grad,
        rhs_q.grad,
        key,
    )
    return out, residuals


def _for_backward(
    cfg: MatmulConfig,
    x: jax.Array,
    forward: QTensor,
    dims: Dims,
    key: jax.Array | None,
    stream: int,
) -> jax.Array | QTensor:
    """A forward operand as the backward matmul ``cfg`` (its rhs) will use it."""
    if cfg.use_fwd_quant:
        return forward
    if cfg.rhs == IDENTITY:
        return x
    (k,) = _keys(key, stream)
    store = cfg.mode == "real"
    return quantize(cfg.rhs, x, dims.rhs_contract, k, store=store).qtensor


def _bwd(
    config: DotGeneralConfig,
    dims: Dims,
    precision: Any,
    preferred_element_type: Any,
    out_sharding: Any,
    residuals: tuple[Any, ...],
    g: jax.Array,
) -> tuple[jax.Array, jax.Array, None]:
    lhs, rhs, lhs_grad, rhs_grad, key = residuals

    def gradient(of, other, grad_dims, cfg, streams):
        return _gradient_matmul(
            g, of, other, grad_dims, cfg, _keys(key, *streams), precision,
            preferred_element_type,
        )  # fmt: skip

    dl = gradient(lhs, rhs, dims.grad_lhs(), config.dlhs, (_DLHS_LHS, _DLHS_RHS))
    dr = gradient(rhs, lhs, dims.grad_rhs(), config.drhs, (_DRHS_LHS, _DRHS_RHS))
    return lhs_grad(dl), rhs_grad(dr), None


def _gradient_matmul(
    g: jax.Array,
    of: Any,
    other: Any,
    grad_dims: tuple[Dims, tuple[int, ...]],
    cfg: MatmulConfig,
    keys: Any,
    precision: Any,
    preferred_element_type: Any,
) -> jax.Array:
    """One gradient matmul, as JAX transposes dot_general.

    ``d_lhs = transpose(g . rhs, perm_l)``, ``d_rhs = transpose(g . lhs,
    perm_r)``: ``g`` against ``other`` (a forward operand, float or already
    quantized for this matmul), returned in the dtype of ``of``.
    """
    dims_, perm = grad_dims
    out, _, _ = matmul(
        g,
        other,
        dims_,
        cfg,
        keys,
        precision=precision,
        preferred_element_type=preferred_element_type,
        out_sharding=_grad_sharding(of, perm),
        out_perm=perm,
    )
    return out.astype(of.dtype)


def _grad_sharding(x: Any, perm: tuple[int, ...]) -> Any:
    """The sharding of a gradient matmul's output, as JAX's transpose rule has it.

    Under a mesh with explicit axes, the gradient of ``x`` gets ``x``'s
    sharding; the matmul computes it before the transpose ``perm``, so its
    output sharding is ``x``'s spec in that earlier axis order. Elsewhere
    sharding is left to propagation (``None``).
    """
    if isinstance(x, QTensor):  # a reused forward operand
        x = x.qvalue
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or AxisType.Explicit not in mesh.axis_types:
        return None
    spec = tuple(sharding.spec) + (None,) * (len(perm) - len(sharding.spec))
    before = [int(i) for i in np.argsort(perm)]  # output axis -> x axis
    return NamedSharding(mesh, PartitionSpec(*(spec[a] for a in before)))


_quantized_dot.defvjp(_fwd, _bwd)
