"""Quantized ``dot_general``: forward and both backward matmuls."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from qbits._errors import InvalidArgumentError
from qbits._tensor import QTensor
from qbits.ops import _core as core
from qbits.ops import _state as state_lib
from qbits.ops._config import DotGeneralConfig, MatmulConfig, check_config
from qbits.ops._dims import Axes, Dims
from qbits.ops._kind import Call, Operand, OpKind
from qbits.ops._matmul import (
    contract,
    dot_shape,
    fold_scale_into_lhs,
    result_dtype,
    stored_rhs,
)
from qbits.ops._op import Op

__all__ = ["KIND", "DotContraction", "DotGeneral", "dot_general"]


@dataclasses.dataclass(frozen=True)
class DotContraction(core.Contraction):
    """A ``lax.dot_general`` as a contraction of the core.

    Attributes:
      dims: The dimension numbers.
      precision: As for ``lax.dot_general`` (hashable).
      preferred_element_type: As for ``lax.dot_general``.
      out_sharding: As for ``lax.dot_general``.
      out_perm: The output is ``transpose(dot, out_perm)`` (the gradient
        matmuls, laid out like their operand), or ``None``.
      shardings: The operands' shardings under a mesh with explicit axes
        (their gradients get them), else ``None`` each.
    """

    dims: Dims
    precision: Any = None
    preferred_element_type: Any = None
    out_sharding: Any = None
    out_perm: Axes | None = None
    shardings: tuple[Any, Any] = (None, None)

    @classmethod
    def create(
        cls,
        dims: Dims,
        precision: Any,
        preferred_element_type: Any,
        out_sharding: Any,
        lhs: Any,
        rhs: Any,
    ) -> DotContraction:
        """The contraction of one call, with the operands' explicit shardings."""
        if isinstance(precision, list):
            precision = tuple(precision)
        return cls(
            dims,
            precision,
            preferred_element_type,
            out_sharding,
            None,
            (_explicit_sharding(lhs), _explicit_sharding(rhs)),
        )

    @property
    def contracting(self) -> tuple[Axes, Axes]:
        """The contracting axes of the lhs and the rhs."""
        return self.dims.lhs_contract, self.dims.rhs_contract

    def __call__(self, lhs: QTensor, rhs: QTensor, cfg: MatmulConfig) -> jax.Array:
        """The dot of two quantized operands (:func:`qbits.ops._matmul.contract`)."""
        return contract(
            lhs,
            rhs,
            self.dims,
            cfg,
            result_dtype(lhs, rhs, self.dims, self.preferred_element_type),
            precision=self.precision,
            preferred_element_type=self.preferred_element_type,
            out_sharding=self.out_sharding,
            out_perm=self.out_perm,
        )

    def plain(self, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        """``lax.dot_general`` itself (then the output permutation)."""
        out = lax.dot_general(
            lhs,
            rhs,
            self.dims.lax(),
            self.precision,
            self.preferred_element_type,
            out_sharding=self.out_sharding,
        )
        if self.out_perm is None or self.out_perm == tuple(range(out.ndim)):
            return out
        return jnp.transpose(out, self.out_perm)

    def gradient(self, side: str) -> DotContraction:
        """The gradient matmul of ``side``, exactly as JAX transposes it."""
        dims, perm = self.dims.grad_lhs() if side == "lhs" else self.dims.grad_rhs()
        of = self.shardings[0 if side == "lhs" else 1]
        return DotContraction(
            dims,
            self.precision,
            self.preferred_element_type,
            _grad_sharding(of, perm),
            perm,
        )

    def reuse(self, rhs: QTensor) -> QTensor | None:
        """The forward operand when its scale factors out of this dot."""
        return rhs if stored_rhs(rhs, self.dims) else None

    def fold(self, lhs: jax.Array, rhs: QTensor) -> jax.Array:
        """``lhs`` times ``rhs``'s scale along the paired axes."""
        return fold_scale_into_lhs(lhs, rhs, self.dims)


def _explicit_sharding(x: Any) -> Any:
    """``x``'s NamedSharding under a mesh with explicit axes, else ``None``."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or AxisType.Explicit not in mesh.axis_types:
        return None
    return sharding


def _grad_sharding(sharding: Any, perm: tuple[int, ...]) -> Any:
    """The sharding of a gradient matmul's output, as JAX's transpose rule has it.

    Under a mesh with explicit axes, the gradient of ``x`` gets ``x``'s
    sharding; the matmul computes it before the transpose ``perm``, so its
    output sharding is ``x``'s spec in that earlier axis order. Elsewhere
    sharding is left to propagation (``None``).
    """
    if sharding is None:
        return None
    spec = tuple(sharding.spec) + (None,) * (len(perm) - len(sharding.spec))
    before = [int(i) for i in np.argsort(perm)]  # output axis -> x axis
    return NamedSharding(sharding.mesh, PartitionSpec(*(spec[a] for a in before)))


@dataclasses.dataclass(frozen=True, eq=False)
class DotGeneral(Op):
    """A drop-in ``jax.lax.dot_general`` that quantizes as its config says.

    Made by :func:`dot_general`; call it exactly like ``lax.dot_general``.
    A config whose quantizers take their scales from state (a
    :class:`~qbits.ScaleProvider` such as
    :class:`~qbits.DelayedScaling`) also needs ``state=``, from
    :meth:`init_state`. It holds its ``config`` (the three matmuls) and
    ``key`` (for stochastic rounding, or ``None``); two are equal when
    those are.

    Example:
      >>> import flax.linen as nn
      >>> dg = qbits.dot_general(qbits.DotGeneralConfig())
      >>> layer = nn.Dense(4, dot_general=dg)
      >>> isinstance(layer.dot_general, qbits.ops.DotGeneral)
      True
    """

    def __call__(
        self,
        lhs: jax.typing.ArrayLike,
        rhs: jax.typing.ArrayLike,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
        *,
        out_sharding: Any = None,
        state: dict[str, jax.Array] | None = None,
        diagnostics: dict[str, jax.Array] | None = None,
    ) -> jax.Array:
        """Computes ``lax.dot_general(lhs, rhs, ...)`` with quantized matmuls.

        A :class:`~qbits.scaled.ScaledArray` operand gives a ScaledArray
        result (the quantization runs on its data; see :mod:`qbits.scaled`).
        ``state`` holds the scale state of the config's providers
        (:meth:`init_state`); its gradient is the next state (see
        :mod:`qbits.ops._state`). ``diagnostics``, a probe (one
        of :func:`qbits.diagnostics.init`'s): its gradient measures every
        quantized operand (:func:`qbits.diagnostics.read`).
        """
        args = (dimension_numbers, precision, preferred_element_type)

        def quantized(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
            c = self._contraction(lhs, rhs, *args, out_sharding)
            return self._run("dot_general", c, lhs, rhs, state, diagnostics)

        return self._apply(
            lhs, rhs,
            lambda a, b: lax.dot_general(a, b, *args, out_sharding=out_sharding),
            quantized, state, diagnostics,
        )  # fmt: skip

    def init_state(
        self,
        lhs: Any,
        rhs: Any,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
    ) -> dict[str, jax.Array]:
        """The initial scale state for operands like these.

        Arrays or ``jax.ShapeDtypeStruct`` s; a learned scale
        (:class:`~qbits.LearnedScale`) starts from the operands' values.

        Example:
          >>> dg = qbits.dot_general(qbits.presets.get("fp8_delayed"))
          >>> state = dg.init_state(jnp.ones((2, 4)), jnp.ones((4, 3)),
          ...                       (((1,), (0,)), ((), ())))
          >>> state["lhs_scale"], state["lhs_amax_history"].shape
          (Array([1.], dtype=float32), (1024,))
        """
        args = (dimension_numbers, precision, preferred_element_type, None)
        return self._init_state(
            "dot_general", lambda a, b: self._contraction(a, b, *args), lhs, rhs
        )

    def _contraction(
        self,
        lhs: Any,
        rhs: Any,
        dimension_numbers: Any,
        precision: Any,
        preferred_element_type: Any,
        out_sharding: Any,
    ) -> DotContraction:
        dims = Dims.create(dimension_numbers, len(lhs.shape), len(rhs.shape))
        # Let lax check shapes and dtypes, with its own messages.
        dot_shape(
            tuple(lhs.shape), np.dtype(lhs.dtype), tuple(rhs.shape),
            np.dtype(rhs.dtype), dims.lax(),
        )  # fmt: skip
        for name, x in (("lhs", lhs), ("rhs", rhs)):
            if not jnp.issubdtype(x.dtype, jnp.floating):
                raise InvalidArgumentError(
                    "dot_general", f"{name}.dtype", x.dtype, "a floating-point dtype"
                )
        return DotContraction.create(
            dims, precision, preferred_element_type, out_sharding, lhs, rhs
        )


def dot_general(config: DotGeneralConfig, key: jax.Array | None = None) -> DotGeneral:
    """A quantized drop-in for ``jax.lax.dot_general``.

    The returned function has exactly the signature of ``lax.dot_general``
    (``precision`` may be positional, ``out_sharding`` is keyword-only), takes
    any dimension numbers, and honours ``precision`` and
    ``preferred_element_type``. Its gradient runs ``config.dlhs`` and
    ``config.drhs``, each quantized as configured, through a custom VJP; a
    numerics' gradient (straight-through, or masked with ``clip_gradient``)
    applies on top. A config that quantizes nothing is ``lax.dot_general``
    itself. Quantizers whose scales come from state (delayed scaling,
    learned steps) take it as the keyword ``state=`` (see
    :meth:`DotGeneral.init_state` and :mod:`qbits.ops._state`).

    Args:
      config: The forward matmul and the two gradient matmuls: a
        :class:`~qbits.DotGeneralConfig`, a preset name (``"int8"``) or the
        path of a YAML file holding one config (as
        :func:`qbits.load_config` reads it).
      key: A PRNG key (``jax.random.key`` or ``jax.random.PRNGKey``, one key),
        required when any operand rounds stochastically.
        The six operands draw from ``qbits.numerics.next_key(key)`` with
        their index i = 0..5 hashed in. Pass a new key each step (and per
        layer) for independent noise; per-layer keys chained with
        ``k = qbits.numerics.next_key(k)`` compile fastest (one kernel for
        every layer's key; a layer index hashed into a key makes a distinct
        small kernel per layer, ``jax.random.fold_in`` a threefry loop of
        several).

    Returns:
      A :class:`DotGeneral`, usable as ``dot_general=`` in ``flax.linen.Dense``
      and ``flax.nnx.Linear``, and as ``jnp.einsum(..., _dot_general=...)``.

    Raises:
      InvalidArgumentError: If the config rounds stochastically and ``key`` is
        ``None`` (at once, rather than inside the backward pass), or ``key``
        is not one PRNG key (typed, or 2 or 4 uint32 words).

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
    config, key = check_config("dot_general", config, key)
    state_lib.check_providers(config, "dot_general")
    return DotGeneral(config, key)


class _DotGeneralKind(OpKind):
    """``dot_general``: the op kind of :func:`dot_general` (``lax.dot_general``)."""

    name = "dot_general"
    primitives = ("dot_general",)
    short = "dot_general"
    limited = ""
    factory = staticmethod(dot_general)

    def call(self, params: Any, operands: list[Any]) -> Call:
        """``(lhs, rhs, dimension_numbers, precision, preferred_element_type)``."""
        p = params
        args = (operands[0], operands[1], p["dimension_numbers"], p.get("precision"),
                p.get("preferred_element_type"))  # fmt: skip
        sharding = p.get("out_sharding")
        return Call(args, {} if sharding is None else {"out_sharding": sharding})

    def operands(self, call: Call, out: tuple[int, ...]) -> tuple[Operand, ...]:
        """As :meth:`DotContraction.gradient` contracts them (``out`` unused)."""
        del out  # from the dimension numbers: the call may be the swapped one
        lhs, rhs = (tuple(x.shape) for x in call.args[:2])
        c = DotContraction(Dims.create(call.args[2], len(lhs), len(rhs)))
        d = c.dims
        g = (*(lhs[a] for a in d.lhs_batch), *(lhs[a] for a in d.lhs_free),
             *(rhs[a] for a in d.rhs_free))  # fmt: skip
        dlhs, drhs = c.gradient("lhs").contracting, c.gradient("rhs").contracting
        return (
            ("fwd", "lhs", lhs, c.contracting[0]),
            ("fwd", "rhs", rhs, c.contracting[1]),
            ("dlhs", "lhs", g, dlhs[0]),
            ("dlhs", "rhs", rhs, dlhs[1]),
            ("drhs", "lhs", g, drhs[0]),
            ("drhs", "rhs", lhs, drhs[1]),
        )

    def is_matmul(self, params: Any) -> bool:
        """A ``dot_general`` that contracts no axis is an elementwise product."""
        return bool(params["dimension_numbers"][0][0])

    def contracting(self, params: Any) -> tuple[tuple[int, ...], ...]:
        """The dimension numbers' contracting axes."""
        return tuple(params["dimension_numbers"][0])


#: The ``dot_general`` op kind.
KIND = _DotGeneralKind()
