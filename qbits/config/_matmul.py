"""The configuration of one quantized matmul and of a dot_general's three.

Plain data below the ops (layer 4), so that the ops, which sit above the
config layer, resolve preset names and files themselves.
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from qbits._errors import InvalidArgumentError, check_bool
from qbits._quantizer import Quantizer
from qbits.numerics import NoNumerics

__all__ = ["IDENTITY", "DotGeneralConfig", "MatmulConfig"]

IDENTITY = Quantizer(NoNumerics())
MODES = ("real", "fake")
_ACCUMULATORS = (np.dtype(np.int32), np.dtype(np.float32))


class MatmulConfig(struct.PyTreeNode):
    """How one matmul quantizes its two operands.

    In ``"real"`` mode the operands are stored in their low-precision dtype
    and fed to the dot: int8 x int8 accumulates in int32, fp8 x fp8 in
    float32, and the output is multiplied by the two scales (which must then
    be shared along the contracting axes, or tiled along one of them). int4
    is widened to int8 and fp4 to bfloat16 inside the computation where XLA
    cannot take it. In ``"fake"`` mode the operands are quantized and
    dequantized and the dot runs in their float dtype. Both give the same
    numbers within float32 rounding.

    Attributes:
      lhs: Quantizer of the left operand. In the backward matmuls of a
        :class:`DotGeneralConfig` the left operand is the incoming gradient.
      rhs: Quantizer of the right operand.
      mode: ``"real"`` or ``"fake"``.
      accumulator: ``None`` (int32 for integer x integer, float32 otherwise),
        ``int32`` or ``float32``. For fp8 GEMMs on a GPU, ``None`` lets the
        tensor cores accumulate in their fast, less precise way;
        ``float32`` asks for full float32 accumulation.
      use_fwd_quant: Backward matmuls only: use the forward pass's quantized
        operand (its stored values and scales) as this matmul's rhs instead of
        quantizing the float operand again with ``rhs``.

    Example:
      >>> int8 = qbits.Quantizer(qbits.IntNumerics(bits=8))
      >>> cfg = qbits.MatmulConfig(lhs=int8, rhs=int8)
      >>> cfg.is_identity
      False
    """

    lhs: Quantizer = struct.field(pytree_node=False, default=IDENTITY)
    rhs: Quantizer = struct.field(pytree_node=False, default=IDENTITY)
    mode: Literal["real", "fake"] = struct.field(pytree_node=False, default="real")
    accumulator: Any = struct.field(pytree_node=False, default=None)
    use_fwd_quant: bool = struct.field(pytree_node=False, default=False)

    def __post_init__(self) -> None:
        for name in ("lhs", "rhs"):
            if not isinstance(getattr(self, name), Quantizer):
                raise InvalidArgumentError(
                    "MatmulConfig", name, getattr(self, name), "a qbits.Quantizer"
                )
        if self.mode not in MODES:
            raise InvalidArgumentError(
                "MatmulConfig", "mode", self.mode, "'real' or 'fake'"
            )
        if self.accumulator is not None:
            try:
                acc = np.dtype(self.accumulator)
            except TypeError:
                acc = None
            if acc not in _ACCUMULATORS:
                raise InvalidArgumentError(
                    "MatmulConfig",
                    "accumulator",
                    self.accumulator,
                    "None, int32 or float32",
                )
            object.__setattr__(self, "accumulator", acc)
        check_bool("MatmulConfig", "use_fwd_quant", self.use_fwd_quant)
        if self.mode == "real":
            for name in ("lhs", "rhs"):
                n = getattr(self, name).numerics
                dtype = n.get_dtype()
                if (
                    not n.clips
                    and dtype is not None
                    and jnp.issubdtype(dtype, jnp.integer)
                ):
                    raise InvalidArgumentError(
                        "MatmulConfig",
                        f"{name}.numerics.clip",
                        False,
                        "True in real mode, or mode='fake'",
                        why="real mode stores the codes as integers, which "
                        "cannot hold values beyond the grid that an unclipped "
                        "fake quantization keeps: the two modes would differ",
                    )

    @property
    def is_identity(self) -> bool:
        """Whether neither operand is quantized."""
        return self.lhs == IDENTITY and self.rhs == IDENTITY

    @property
    def needs_key(self) -> bool:
        """Whether an operand rounds stochastically and needs a PRNG key."""
        return any(
            getattr(q.numerics, "noise_fn", None) is not None
            for q in (self.lhs, self.rhs)
        )


class DotGeneralConfig(struct.PyTreeNode):
    """The three matmuls of a ``dot_general`` and its gradient.

    ``fwd`` computes ``out = lhs . rhs``; ``dlhs`` computes the gradient of the
    lhs from the output gradient ``g`` and the rhs; ``drhs`` the gradient of the
    rhs from ``g`` and the lhs. In both backward matmuls the config's ``lhs``
    quantizer applies to ``g`` and its ``rhs`` quantizer to the other forward
    operand (AQT's convention).

    Attributes:
      fwd: The forward matmul.
      dlhs: The matmul giving the lhs gradient: ``g . rhs``.
      drhs: The matmul giving the rhs gradient: ``g . lhs``.

    Raises:
      InvalidArgumentError: If ``fwd.use_fwd_quant`` is set, or a backward
        matmul reuses a forward operand the forward matmul does not store.

    Example:
      >>> int8 = qbits.MatmulConfig(
      ...     lhs=qbits.Quantizer(qbits.IntNumerics(bits=8)),
      ...     rhs=qbits.Quantizer(qbits.IntNumerics(bits=8)))
      >>> forward_only = qbits.DotGeneralConfig(fwd=int8)
      >>> forward_only.dlhs.is_identity
      True
    """

    fwd: MatmulConfig = struct.field(pytree_node=False, default=MatmulConfig())
    dlhs: MatmulConfig = struct.field(pytree_node=False, default=MatmulConfig())
    drhs: MatmulConfig = struct.field(pytree_node=False, default=MatmulConfig())

    def __post_init__(self) -> None:
        for name in ("fwd", "dlhs", "drhs"):
            if not isinstance(getattr(self, name), MatmulConfig):
                raise InvalidArgumentError(
                    "DotGeneralConfig",
                    name,
                    getattr(self, name),
                    "a qbits.MatmulConfig",
                )
        if self.fwd.use_fwd_quant:
            raise InvalidArgumentError(
                "DotGeneralConfig",
                "fwd.use_fwd_quant",
                True,
                "False (only backward matmuls can reuse forward operands)",
            )
        for name, side in (("dlhs", "rhs"), ("drhs", "lhs")):
            if (
                getattr(self, name).use_fwd_quant
                and getattr(self.fwd, side) == IDENTITY
            ):
                raise InvalidArgumentError(
                    "DotGeneralConfig",
                    f"{name}.use_fwd_quant",
                    True,
                    f"False when fwd.{side} does not quantize",
                )

    @property
    def is_identity(self) -> bool:
        """Whether none of the three matmuls quantizes."""
        return all(m.is_identity for m in (self.fwd, self.dlhs, self.drhs))

    @property
    def needs_key(self) -> bool:
        """Whether any of the three matmuls rounds stochastically."""
        return any(m.needs_key for m in (self.fwd, self.dlhs, self.drhs))

    @property
    def is_weight_only(self) -> bool:
        """Whether only the forward's weight (its rhs) is quantized.

        The forward's lhs (the activation) and both backward matmuls
        quantize nothing: ``int4_weight_only``, ``nf4``, ``w4g128_asym``.

        Example:
          >>> qbits.presets.get("nf4").is_weight_only
          True
          >>> qbits.presets.get("w4a8").is_weight_only
          False
        """
        return (
            self.fwd.rhs != IDENTITY
            and self.fwd.lhs == IDENTITY
            and self.dlhs.is_identity
            and self.drhs.is_identity
        )

    def for_activations(self) -> DotGeneralConfig | None:
        """The config a matmul of two activations runs (it has no weight).

        In qbits a config's forward ``lhs`` is the activation quantizer and
        its ``rhs`` the weight quantizer (the engine runs ``w @ x`` as
        ``x @ w``, so that the weight is always the rhs). A matmul whose
        operands are both activations (attention's ``q . k`` and
        ``p . v``) has no weight, so the rule's config is adapted to it
        here, for every rule alike (a rule written for such a matmul too):

        - a weight-only config (:attr:`is_weight_only`) leaves it float
          (``None``): it has no weight to quantize;
        - otherwise the forward's rhs takes the forward lhs's quantizer (the
          activation quantizer on both operands: ``w4a8`` runs int8 x int8
          there), and the backward matmuls are as configured.

        Configs that quantize both forward operands alike (``int8``,
        ``fp8``, ``mxfp8``, ``nvfp4``...) are returned unchanged.
        ``qbits.dot_general(config)`` passed to a layer by hand runs
        ``config`` as it is.

        Returns:
          The config the engine runs for a matmul with no weight operand,
          or ``None`` (float).

        Example:
          >>> w4a8 = qbits.presets.get("w4a8")
          >>> w4a8.fwd.rhs.numerics.bits, w4a8.for_activations().fwd.rhs.numerics.bits
          (4, 8)
          >>> qbits.presets.get("int4_weight_only").for_activations() is None
          True
          >>> int8 = qbits.presets.get("int8")
          >>> int8.for_activations() == int8
          True
        """
        if self.is_weight_only:
            return None
        if self.fwd.rhs == self.fwd.lhs:
            return self
        dlhs = self.dlhs
        if dlhs.use_fwd_quant and self.fwd.lhs == IDENTITY:  # no forward rhs to reuse
            dlhs = dlhs.replace(use_fwd_quant=False)
        return self.replace(fwd=self.fwd.replace(rhs=self.fwd.lhs), dlhs=dlhs)

    @property
    def needs_state(self) -> bool:
        """Whether a quantizer takes its scale from state (has a provider).

        Example:
          >>> qbits.presets.get("fp8_delayed").needs_state
          True
        """
        return any(q.provider is not None for _, _, q in self.quantizers())

    def quantizers(self) -> tuple[tuple[str, str, Quantizer], ...]:
        """``(tensor, place, quantizer)`` of the six operands.

        The tensor is what the quantizer quantizes: ``"lhs"``, ``"rhs"`` or
        ``"grad"`` (the output gradient, the lhs of both backward matmuls);
        the place is ``"fwd.lhs"`` and so on.
        """
        return (
            ("lhs", "fwd.lhs", self.fwd.lhs),
            ("rhs", "fwd.rhs", self.fwd.rhs),
            ("grad", "dlhs.lhs", self.dlhs.lhs),
            ("rhs", "dlhs.rhs", self.dlhs.rhs),
            ("grad", "drhs.lhs", self.drhs.lhs),
            ("lhs", "drhs.rhs", self.drhs.rhs),
        )

    def state_kinds(self) -> dict[str, str]:
        """Which scale-state entries are replaced and which are trained.

        Returns:
          ``{"<tensor>_<name>": "replaced" | "trained"}``: delayed scales are
          replaced by the backward pass, learned steps trained by the
          optimizer (their shapes do not matter here).

        Example:
          >>> kinds = qbits.presets.get("fp8_delayed").state_kinds()
          >>> sorted(kinds.items())[:2]
          [('grad_amax_history', 'replaced'), ('grad_scale', 'replaced')]
        """
        kinds: dict[str, str] = {}
        for tensor, _, q in self.quantizers():
            p = q.provider
            if p is None:
                continue
            example = jax.eval_shape(
                lambda p=p, q=q: p.init_state((), None, q.numerics)
            )
            for name in example:
                kinds[f"{tensor}_{name}"] = "trained" if p.trainable else "replaced"
        return kinds
