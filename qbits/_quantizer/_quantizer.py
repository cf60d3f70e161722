"""Layer 3: Quantizer = numerics + calibration + granularity."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from qbits._calibration import (
    SCALE_ROUNDINGS,
    AbsMax,
    Calibration,
    ConstantBound,
    MseSearch,
    ScaleRounding,
    make_scale,
    scale_limits,
)
from qbits._context import Context
from qbits._errors import InvalidArgumentError, check_choice
from qbits._formats import check_float_input, compute_dtype
from qbits._granularity import BlockLayout, Granularity, PerTensor
from qbits._jaxpr import varying
from qbits._platform import per_platform
from qbits._providers import ScaleProvider
from qbits._quantizer._arithmetic import (
    flat_vector,
    given_scale,
    negatives_stay_negative,
    scales_and_inverses,
)
from qbits._quantizer._double import check_double_quant, double_quantize
from qbits._quantizer._storage import blocked, encode, to_storage
from qbits._quantizer._two_level import check_tensor_amax, quantize_two_level
from qbits._quantizer._zero_point import quantize_asymmetric
from qbits._sharding import alike
from qbits._tensor import QTensor, decode_scale
from qbits.numerics import QNumerics

__all__ = ["Quantizer", "Request", "quantize_all"]

# Scale roundings of a Quantizer: calibration's, and two-level E4M3 block
# scales under a tensor scale (NVFP4, :mod:`qbits._quantizer._two_level`).
_ROUNDINGS = (*SCALE_ROUNDINGS, "e4m3")


class Quantizer(struct.PyTreeNode):
    r"""Quantizes a tensor: calibrate each block, scale, put on the grid.

    For each scale block (see ``granularity``) the calibration gives a bound;
    the scale is ``bound / numerics.abs_val_mapped_to()`` (rounded as
    ``scale_rounding`` says), and

    .. math:: q = \mathrm{numerics}(x \cdot (1 / s)), \qquad \hat{x} = q \cdot s.

    Scales are computed in float32 and carry no gradient, so the fake
    quantization ``quant(x).dequant()`` has exactly the numerics' gradient
    (straight-through, or masked with ``clip_gradient``). Inputs of every
    float dtype are quantized in float32 (float64 stays); ``dequant`` returns
    the input's dtype. With :class:`~qbits.numerics.NoNumerics` the input comes back
    bit for bit.

    Edge cases (the calibrations' rules):

    - A block holding a NaN or an inf dequantizes to NaN.
    - A block whose bound is 0 (all zeros) has scale 1 and dequantizes to
      exact zeros, on grids without a zero too (its codes are 0, off the
      grid), with the straight-through gradient.
    - Tiny blocks get scales down to float32's smallest normal, so they keep
      their values as far as float32 resolves them, except that XLA:CPU
      reads float32 subnormals (below ``2**-126``, about ``1.18e-38``) as
      zero: there a block whose largest magnitude is subnormal quantizes
      to exact zeros, a subnormal element to 0. Huge finite blocks (up
      to the dtype's largest value) dequantize to finite values of the right
      sign: scales are capped so the scaled grid fits the input's dtype, and
      grids whose top is below 4 (int1..int3) divide by a huge scale in two
      exact steps (its reciprocal would be subnormal, flushed to 0 on CPU).
    - Under ``jax_enable_x64`` the computation keeps the input's compute
      dtype (float32, or float64 for float64 input).
    - A zero-size input gives an empty QTensor; a shared axis of size 0 has
      one scale entry (1), a per-index or tiled one none.
    - Asymmetric grids (:class:`~qbits.numerics.UintNumerics`) get a scale
      and an integer zero point per block, the calibration giving the
      block's range (:mod:`qbits._quantizer._zero_point`); ``QTensor``
      keeps the zero points. ``scale_rounding="e4m3"`` gives NVFP4's
      two-level scales: E4M3 block scales under a float32 tensor scale
      (:mod:`qbits._quantizer._two_level`). Neither takes a scale provider.
    - ``double_quant=True``: the float32 scales are quantized in turn
      (:mod:`qbits._quantizer._double`); the QTensor holds them decoded,
      or stored (``store=True``) their codes.
    - The gradient of ``quant(x).dequant()`` is ``(g * s) * (1 / s)``:
      in float32 it flushes to 0 where ``|g| * s`` is below ``2**-126`` and
      overflows where it exceeds float32's largest value (blocks at
      float32's extremes). :meth:`quant_vjp`'s gradient, which qbits'
      matmuls use, applies the numerics' gradient to ``g`` directly and has
      no such limit.

    Attributes:
      numerics: The grid (:class:`~qbits.IntNumerics`,
        :class:`~qbits.FpNumerics`, :class:`~qbits.numerics.NoNumerics`, ...).
      calibration: How each block's bound is found.
      granularity: Which elements share a scale.
      scale_rounding: ``"none"``, ``"pow2"`` or ``"e8m0"`` (power of two
        rounded up); or
        ``"e4m3"``: float8_e4m3fn block scales under a float32 scale for
        the whole tensor (NVFP4's two-level scaling).
      provider: A scale provider (scales from state), or ``None``.
      double_quant: Quantize the scales too, as bitsandbytes'
        ``bnb_4bit_use_double_quant`` (``nf4_dq``: 4.127 bits a weight).
      tensor_amax: With ``scale_rounding="e4m3"``: the amax the tensor
        scale is computed from, fixed (a calibrated global scale, as NVFP4
        W4A4 checkpoints ship their inputs'); ``None``: each tensor's own.

    Example:
      >>> import jax.numpy as jnp
      >>> q = qbits.Quantizer(qbits.IntNumerics(bits=8),
      ...                     granularity=qbits.PerChannel(shared_axes=(0,)))
      >>> w = jnp.array([[1.0, -0.02], [-0.5, 0.04]])
      >>> qt = q.quant(w, store=True)
      >>> qt.qvalue
      Array([[127, -64],
             [-64, 127]], dtype=int8)
      >>> qt.scale.shape
      (1, 2)
    """

    numerics: QNumerics = struct.field(pytree_node=False)
    calibration: Calibration = struct.field(pytree_node=False, default=AbsMax())
    granularity: Granularity = struct.field(pytree_node=False, default=PerTensor())
    scale_rounding: ScaleRounding | Literal["e4m3"] = struct.field(
        pytree_node=False, default="none"
    )
    provider: ScaleProvider | None = struct.field(pytree_node=False, default=None)
    double_quant: bool = struct.field(pytree_node=False, default=False)
    tensor_amax: float | None = struct.field(pytree_node=False, default=None)

    def __post_init__(self) -> None:
        if isinstance(self.calibration, ScaleProvider):
            raise InvalidArgumentError(
                "Quantizer",
                "calibration",
                self.calibration,
                "a qbits Calibration (a scale computed from the tensor); a "
                f"scale provider goes in provider=: Quantizer(numerics, "
                f"provider={type(self.calibration).__name__}(...))",
            )
        for name, kind, label in (
            ("numerics", QNumerics, "QNumerics"),
            ("calibration", Calibration, "Calibration"),
            ("granularity", Granularity, "Granularity"),
            ("provider", ScaleProvider | type(None), "ScaleProvider or None"),
        ):
            if not isinstance(getattr(self, name), kind):
                raise InvalidArgumentError(
                    "Quantizer", name, getattr(self, name), f"a qbits {label}"
                )
        check_choice("Quantizer", "scale_rounding", self.scale_rounding, _ROUNDINGS)
        asymmetric = self.numerics.asymmetric
        if asymmetric and self.scale_rounding != "none":
            raise InvalidArgumentError(
                "Quantizer",
                "scale_rounding",
                self.scale_rounding,
                f"'none' with {type(self.numerics).__name__} (an asymmetric "
                "grid's scale and zero point are not rounded)",
            )
        check_double_quant(self)
        check_tensor_amax(self)
        if self.provider is not None and (asymmetric or self.scale_rounding == "e4m3"):
            what = "a zero point" if asymmetric else "a two-level (e4m3) scale"
            raise InvalidArgumentError(
                "Quantizer",
                "provider",
                self.provider,
                f"None with {what}: it is computed from the tensor by a "
                "calibration (calibration=AbsMax() or MseSearch())",
            )

    def quant(
        self,
        x: jax.Array,
        context: Context | None = None,
        *,
        store: bool = False,
        contracting_axes: tuple[int, ...] | None = None,
    ) -> QTensor:
        """Quantizes ``x``.

        Args:
          x: A floating-point array.
          context: Carries the PRNG key for stochastic rounding.
          store: Return ``qvalue`` in the storage dtype (int8, int4, fp8; fp6
            in bfloat16) for real low-precision matmuls and serving. Stored
            integers cannot carry a gradient, so differentiating through a
            stored quantization raises; the default keeps ``qvalue`` in
            float32 (exactly the same numbers) and differentiable. Stored
            integers saturate at the storage dtype's range; the codes of a
            block whose scale is NaN (it held a NaN or inf) are unspecified.
          contracting_axes: When ``x`` is a matmul operand, the axes the
            matmul contracts; granularities with axes left as ``None`` use
            them.

        Returns:
          A :class:`~qbits.QTensor`.

        Raises:
          InvalidArgumentError: If ``x`` is not floating point, the granularity
            does not fit its shape, stochastic rounding has no key, or
            ``store=True`` for numerics without a storage dtype.
        """
        qt, _ = self._quantize(x, context, store, contracting_axes, vjp=False)
        return qt

    def quant_vjp(
        self,
        x: jax.Array,
        context: Context | None = None,
        *,
        store: bool = False,
        contracting_axes: tuple[int, ...] | None = None,
        scale: jax.Array | None = None,
    ) -> tuple[QTensor, jax.tree_util.Partial]:
        """Quantizes ``x`` for use inside a custom VJP.

        Like :meth:`quant`, but not differentiable itself: it also returns the
        gradient of the fake quantization, a pytree-valued function
        ``grad(g) -> dx`` (the numerics' :meth:`~qbits.numerics.QNumerics.vjp_bwd`)
        that can be kept as a residual. Numerics are elementwise, so
        ``dx = vjp_bwd(residuals, g)`` needs no scaling.

        ``scale`` gives the scale (one entry per block, the scale's shape)
        instead of calibrating: required when the calibration is a scale
        provider (:class:`~qbits.ScaleProvider`), which takes it from state.

        Returns:
          ``(qtensor, grad)``.

        Example:
          >>> import jax.numpy as jnp
          >>> q = qbits.Quantizer(qbits.IntNumerics(bits=8, clip_gradient=True),
          ...                     qbits.ConstantBound(1.0))
          >>> qt, grad = q.quant_vjp(jnp.array([0.5, 2.0]))
          >>> grad(jnp.array([1.0, 1.0]))
          Array([1., 0.], dtype=float32)
        """
        return self._quantize(
            x, context, store, contracting_axes, vjp=True, given=scale
        )

    def _quantize(
        self,
        x: jax.Array,
        context: Context | None,
        store: bool,
        contracting_axes: tuple[int, ...] | None,
        *,
        vjp: bool,
        given: jax.Array | None = None,
    ) -> tuple[QTensor, jax.tree_util.Partial | None]:
        request = Request(self, x, context, store, contracting_axes, given)
        (out,) = quantize_all([request], vjp=vjp)
        return out


class Request(NamedTuple):
    """One tensor for :func:`quantize_all`: what :meth:`Quantizer.quant` takes.

    Attributes:
      quantizer: How to quantize it.
      x: The tensor, or a ``jax.ShapeDtypeStruct``: a placeholder that keeps
        its place in the batched scale arithmetic (as zeros) without being
        quantized, so that a program without it keeps the same kernels.
      context: Carries the PRNG key for stochastic rounding.
      store: Return the values in the storage dtype.
      contracting_axes: The axes a matmul contracts, or ``None``.
      scale: The given scale of a quantizer with a scale provider, or ``None``.
    """

    quantizer: Quantizer
    x: jax.Array | jax.ShapeDtypeStruct
    context: Context | None = None
    store: bool = False
    contracting_axes: tuple[int, ...] | None = None
    scale: jax.Array | None = None


def quantize_all(
    requests: Sequence[Request], *, vjp: bool
) -> list[tuple[QTensor, jax.tree_util.Partial | None]]:
    """Quantizes several tensors, as :meth:`Quantizer.quant` (``quant_vjp``).

    Each tensor is calibrated on its own; then the per-block arithmetic
    that turns bounds into scales and their inverses runs once for every
    group of tensors whose quantizers do the same arithmetic, on their
    bounds laid end to end. The numbers are those of quantizing each tensor
    alone; XLA compiles one small kernel per group instead of one per
    tensor (a quantized matmul quantizes four tensors in its forward pass
    and two in its backward).

    Returns:
      ``(qtensor, grad)`` per request (``None`` for a placeholder); ``grad``
      is ``None`` unless ``vjp``.
    """
    out: list[Any] = [None] * len(requests)
    groups: dict[Any, list[tuple[int, _Pending]]] = {}
    seen: dict[Any, int] = {}
    copies: list[tuple[int, int]] = []
    for i, request in enumerate(requests):
        same = _identity_of(request)
        if same in seen:  # the same tensor quantized the same way: once
            copies.append((i, seen[same]))
            continue
        seen[same] = i
        pending = _calibrate(request, vjp)
        if isinstance(pending, _Pending):
            groups.setdefault(pending.group, []).append((i, pending))
        else:
            out[i] = pending
    for members in groups.values():
        first = members[0][1]
        make = first.scale_of if first.bound is not None else None
        scales = scales_and_inverses([p.flat for _, p in members], make, first.split)
        for (i, p), (scale, inverse, pre) in zip(members, scales, strict=True):
            placeholder = isinstance(p.x, jax.ShapeDtypeStruct)
            out[i] = None if placeholder else _encode(p, scale, inverse, pre, vjp)
    for i, first in copies:
        out[i] = out[first]
    return out


def _identity_of(request: Request) -> Any:
    """What makes two requests one quantization.

    The same quantizer, tensor, scale blocks, storage and given scale, and
    the same key where noise is drawn. (XLA's CSE would merge them otherwise, but not
    once their scale arithmetic shares a kernel with other tensors'.)
    """
    q, x = request.quantizer, request.x
    noisy = getattr(q.numerics, "noise_fn", None) is not None
    key = request.context.key if noisy and request.context is not None else None
    blocks = q.granularity.block_sizes(jnp.shape(x), request.contracting_axes)
    return (q, id(x), blocks, request.store, id(request.scale), id(key))


@dataclasses.dataclass(frozen=True)
class _Pending:
    """A tensor calibrated, waiting for its scale (see :func:`quantize_all`)."""

    request: Request
    x: jax.Array
    xb: jax.Array
    layout: BlockLayout
    bound: jax.Array | None
    flat: jax.Array
    blocks: tuple[int, ...]
    qdtype: Any
    split: bool
    scale_of: Any
    group: Any


def _calibrate(
    request: Request, vjp: bool
) -> _Pending | tuple[QTensor, jax.tree_util.Partial | None]:
    """A request's checks and bound (or given scale): the work before its scale."""
    self, context, store, given = (
        request.quantizer,
        request.context,
        request.store,
        request.scale,
    )
    placeholder = isinstance(request.x, jax.ShapeDtypeStruct)
    x = request.x if placeholder else check_float_input("Quantizer.quant", request.x)
    if given is None and self.provider is not None:
        raise InvalidArgumentError(
            "Quantizer.quant",
            "scale",
            None,
            "a given scale: this quantizer's scale comes from state "
            f"({type(self.provider).__name__}); quantize with "
            "qbits.dot_general(config)(..., state=...) or through "
            "qbits.flax.quantize / qbits.nnx.quantize, which keep it",
        )
    qdtype = self.numerics.get_dtype()
    if store and qdtype is None and not self.numerics.is_identity:
        raise InvalidArgumentError(
            "Quantizer.quant",
            "store",
            True,
            "False for these numerics",
            why=f"{self.numerics!r} has no storage dtype",
        )
    if self.numerics.is_identity:
        qt = QTensor(x, jnp.ones((1,) * x.ndim, jnp.float32), dtype=x.dtype)
        return qt, (jax.tree_util.Partial(_identity) if vjp else None)
    if self.numerics.asymmetric or self.scale_rounding == "e4m3":
        request = request._replace(x=x)
        found = blocked(request, vjp)
        if found is None:  # a placeholder
            return None
        own = quantize_asymmetric if self.numerics.asymmetric else quantize_two_level
        return own(request, found, vjp)

    blocks = self.granularity.block_sizes(x.shape, request.contracting_axes)
    layout = BlockLayout.create(x.shape, blocks)
    compute = compute_dtype(x.dtype)
    xb = None if placeholder else x.astype(compute).reshape(layout.blocked_shape)
    mapped = self.numerics.abs_val_mapped_to()
    scale_of = functools.partial(
        make_scale,
        abs_val_mapped_to=mapped,
        rounding=self.scale_rounding,
        dtype=x.dtype,
    )

    def quantize(v: jax.Array, bound: jax.Array) -> jax.Array:
        s = scale_of(bound)
        return self.numerics.fwd(v / s, context) * s

    # quant_vjp is never differentiated (it runs inside custom VJPs), so
    # only quant needs the gradient stops (and the storage-cast guard).
    no_grad = (lambda v: v) if vjp else lax.stop_gradient
    if placeholder:  # a place in its group's scale kernel, zeros
        bound = None if given is not None else jnp.zeros(layout.scale_shape, compute)
        blocks = layout.scale_shape
        flat = jnp.zeros(layout.scale_shape, compute).reshape(-1)
    elif given is not None:
        bound = None
        blocks = layout.reduced_shape
        flat = flat_vector(given_scale(given, layout.scale_shape, compute))
    else:
        if x.size and _exact_in_input_dtype(self.calibration, x.dtype):
            # The same bound from the tensor as it is (no float32 copy: a
            # weight's amax on a GPU otherwise reads a transposed float32
            # copy that layout assignment gives the copy the cast shares).
            own = no_grad(x).reshape(layout.blocked_shape)
            bound = self.calibration(own, layout.reduce_axes).astype(compute)
        elif x.size:
            bound = self.calibration(no_grad(xb), layout.reduce_axes, quantize)
        else:  # nothing to calibrate: every (empty) block gets scale 1
            bound = jnp.zeros(layout.reduced_shape, xb.dtype)
        blocks = bound.shape
        flat = flat_vector(no_grad(bound))
    # A scale above 2**126 has a subnormal inverse, which XLA:CPU flushes
    # to zero (grids whose top is below 4: int1..int3). Such blocks are
    # divided in two exact steps, a power of two first.
    split = scale_limits(mapped, self.scale_rounding, x.dtype)[1] > 2.0**126
    # The scale arithmetic of tensors in one group runs on their bounds laid
    # end to end: same arithmetic (given or made from a bound with the same
    # mapping, rounding and dtype), flat vectors of one dtype that vary along
    # the same manual mesh axes inside shard_map (laid end to end with a
    # replicated weight's, an activation's bound would make the weight's
    # scale vary per shard in one platform's branch and not in the other's).
    # Scales that keep their shape (sharded along explicit mesh axes, see
    # flat_vector) run alone.
    group: Any = (
        bound is None,
        None if bound is None else (mapped, self.scale_rounding, np.dtype(x.dtype)),
        split,
        np.dtype(flat.dtype),
        varying(flat),
    )
    if flat.ndim != 1:
        group = (group, id(flat))
    return _Pending(
        request, x, xb, layout, bound, flat, blocks, qdtype, split, scale_of, group
    )


def _encode(
    p: _Pending,
    scale: jax.Array,
    inverse: jax.Array,
    pre: jax.Array | None,
    vjp: bool,
) -> tuple[QTensor, jax.tree_util.Partial | None]:
    """Puts a calibrated tensor on its grid with its scale and inverse."""
    self, context, x, layout, blocks = (
        p.request.quantizer,
        p.request.context,
        p.x,
        p.layout,
        p.blocks,
    )
    scale, inverse = scale.reshape(blocks), inverse.reshape(blocks)
    xb = p.xb

    def times(v: jax.Array, per_block: jax.Array) -> jax.Array:
        # lax, not jnp: jnp's broadcasting multiply is a small jitted
        # function, traced anew for every shape (trace time per layer).
        # A per-tensor scale is tied to the tensor (fp8, sharded LM: -6
        # all-gathers, -5 all-reduces, -2 all-to-alls per block); a
        # per-channel one not: XLA then makes an FSDP weight's scale on
        # shards of its other axis and gathers it
        # (benchmarks/sharded_collectives.py).
        dims = tuple(range(v.ndim))
        b = lax.broadcast_in_dim(per_block.reshape(blocks), v.shape, dims)
        return lax.mul(*(alike(v, b) if per_block.size == 1 else (v, b)))

    numerics = self.numerics
    unclipped = numerics.unclipped() if p.request.store else None
    if pre is None and unclipped is not None:
        # The numerics' clip, done here: on a GPU in a chain of its own (see
        # QNumerics.unclipped). cuBLASLt's int8 GEMM runs at full rate only
        # with both operands contiguous along the contracting axes (else a
        # kernel 12x slower, measured on an H200); two
        # quantizations of one tensor (a weight's forward codes and its
        # input-gradient codes) would otherwise share nodes (the conversion,
        # the broadcast bounds), and layout assignment one layout for both.
        lo, hi = (np.asarray(b, xb.dtype) for b in numerics.gradient_range())
        dims = tuple(range(xb.ndim))

        def here(xb: jax.Array, inverse: jax.Array) -> jax.Array:
            return lax.clamp(lo, times(xb, inverse), hi)

        def apart(xb: jax.Array, inverse: jax.Array) -> jax.Array:
            bounds = jnp.stack([jnp.full(blocks, lo), jnp.full(blocks, hi)])
            x, inverse, bounds = lax.optimization_barrier((p.x, inverse, bounds))
            y = times(x.astype(xb.dtype).reshape(xb.shape), inverse)
            low, high = (lax.broadcast_in_dim(b, y.shape, dims) for b in bounds)
            return lax.clamp(low, y, high)

        y = per_platform(xb, inverse, cpu=here, cuda=apart, default=here)
        numerics = unclipped
    elif pre is None:
        y = times(xb, inverse)
    else:
        y = times(times(xb, pre), inverse)
    if not self.numerics.has_zero:
        # A value far below its block's scale underflows to a zero here
        # (flushed, maybe -0.0 for a negative value), and a grid without a
        # zero rounds a zero up: a negative value must stay negative.
        y = negatives_stay_negative(y, xb)
    if p.request.store:  # the storage cast follows (see Context.cast_next)
        key = None if context is None else context.key
        context = Context(key, cast_next=True)
    q, grad = encode(numerics, y, context, layout, vjp)
    if p.bound is not None and not (
        self.numerics.keeps_zero
        and isinstance(self.calibration, _ZERO_BOUND_MEANS_ZEROS)
    ):
        # A block whose bound is 0 dequantizes to exact zeros, also on a
        # grid without a zero (binary's 0 -> +0.5). The subtracted copy
        # carries no gradient: the codes keep the numerics' gradient.
        zero = lax.convert_element_type(
            lax.eq(p.bound, lax.full_like(p.bound, 0)), q.dtype
        )
        q = q - times(lax.stop_gradient(q), zero)
    q = q.reshape(x.shape)
    if p.request.store:
        clipped = self.numerics.clips
        codes = getattr(self.numerics, "codes", None)  # a codebook's indices
        q = to_storage(q, p.qdtype, saturate=not clipped, guard=not vjp, codes=codes)
    scale = scale.reshape(layout.scale_shape).astype(jnp.float32)
    codebook = self.numerics.codebook if p.request.store else None
    nested: dict[str, jax.Array] = {}
    if self.double_quant:  # the scales quantized in turn, as bitsandbytes does
        codes, absmax, offset = double_quantize(scale)
        if p.request.store:
            scale, nested = codes, {"scale_absmax": absmax, "scale_offset": offset}
        else:
            scale = decode_scale(codes, absmax, offset)
    qt = QTensor(q, scale, qdtype=p.qdtype, dtype=x.dtype, codebook=codebook, **nested)
    return qt, grad


# Calibrations whose bound is 0 only for a block of zeros (or of values so
# small that every grid with a zero rounds them to it at scale 1).
_ZERO_BOUND_MEANS_ZEROS = (AbsMax, MseSearch, ConstantBound)


def _exact_in_input_dtype(calibration: Any, dtype: Any) -> bool:
    """Whether ``calibration`` gives the same bound on a tensor's own dtype.

    The absmax (clip factor 1) is: magnitudes and their maximum are exact
    in any float type, and a narrower float widens exactly to float32.
    """
    return (
        type(calibration) is AbsMax
        and calibration.clip_factor == 1.0
        and np.dtype(dtype) in (np.dtype(jnp.bfloat16), np.dtype(np.float16))
    )


def _identity(g: jax.Array) -> jax.Array:
    return g
