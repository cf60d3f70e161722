"""Integer numerics: int8, int4, ternary-like grids and binary."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import struct
from jax import lax

from qbits._context import Context
from qbits._errors import InvalidArgumentError, check_bool, check_int
from qbits._formats import check_float_input, compute_dtype
from qbits.numerics._base import (
    ClippedStraightThrough,
    NoiseFn,
    integer_dtype,
    require_key,
)

__all__ = ["IntNumerics"]

_STORAGE_BY_BITS = ((4, ml_dtypes.int4), (8, np.int8), (16, np.int16))


class IntNumerics(ClippedStraightThrough):
    r"""A symmetric integer grid: int8, int4, ..., binary.

    The input is already divided by the scale, so the calibration bound sits at
    :meth:`abs_val_mapped_to`. With ``preserve_zero`` the grid holds the
    integers :math:`-(2^{b-1}-1) .. 2^{b-1}-1` (``2**bits - 1`` levels: one
    bucket is lost to keep an exact zero); without it the grid holds the
    half-integers :math:`\pm 0.5, \pm 1.5, .., \pm(2^{b-1}-0.5)` (``2**bits``
    levels; ``bits=1`` is binary, :math:`\pm 0.5`).

    With ``preserve_max_val=False`` the bound maps onto the *edge* of the last
    bucket (127.5 for int8 with ``preserve_zero``; values there clip to 127);
    with ``True`` it maps onto the bucket's centre (127), so the maximum is
    represented exactly.

    The forward pass adds ``noise_fn`` noise (stochastic rounding), clips to
    the grid's range, then rounds (to nearest even, or to the nearest
    half-integer without ``preserve_zero``). The gradient is straight-through;
    with ``clip_gradient`` it is zero where the input lay outside the clip
    range.

    Stochastic rounding is unbiased on the grid's range, not beyond its top
    code: with ``preserve_zero`` and ``preserve_max_val=False`` (AQT's grid,
    the presets') the bound maps onto 127.5 (int8) but the top code is 127,
    so an input in (127, 127.5] always comes back as 127. Each block's
    largest element (at 127.5) thus comes back as ``bound * 254/255`` every
    time: 0.39% low, in one direction. Measured on gradient-like blocks,
    this bias is 2e-4 (normal values, blocks of 4096) to 2e-3 (Student-t(3),
    blocks of 64) of the tensor's norm; below the top code, the mean of the
    stochastic rounding is the input. With ``preserve_max_val=True`` the
    bound maps onto 127 and stochastic rounding is unbiased on every value
    (a grid step 0.4% coarser). Rounding to nearest is unaffected (and
    equal to AQT's).

    Attributes:
      bits: Number of bits, 1..16.
      preserve_zero: Keep an exact zero on the grid (loses one level).
      preserve_max_val: Map the bound onto a bucket centre, not an edge.
      clip: Clip to the grid's range before rounding.
      clip_gradient: Zero the gradient outside the clip range.
      round: Round onto the grid (``False`` only clips).
      noise_fn: Noise added before rounding (e.g. ``UniformNoise()``) for
        stochastic rounding; needs a ``Context`` with a key.
      dtype: Integer storage dtype for the real path. ``None`` picks the
        narrowest of int4/int8/int16 that holds the grid; it stays ``None``
        when the grid is not integers (``preserve_zero=False`` or
        ``round=False``), which have no integer storage.

    Raises:
      InvalidArgumentError: For bits outside 1..16, a storage dtype that is not
        a signed integer or is too small for the bits, a storage dtype for a
        grid that is not integers, or ``bits=1`` with ``preserve_zero``.

    Example:
      >>> import jax.numpy as jnp
      >>> int8 = qbits.IntNumerics(bits=8)
      >>> int8.abs_val_mapped_to(), int8.get_dtype()
      (127.5, dtype('int8'))
      >>> int8(jnp.array([-200.0, -0.4, 3.5, 127.4]))
      Array([-127.,   -0.,    4.,  127.], dtype=float32)
      >>> binary = qbits.IntNumerics(bits=1, preserve_zero=False)
      >>> binary(jnp.array([-3.0, -0.1, 0.2, 9.0]))
      Array([-0.5, -0.5,  0.5,  0.5], dtype=float32)
    """

    bits: int = struct.field(pytree_node=False, default=8)
    preserve_zero: bool = struct.field(pytree_node=False, default=True)
    preserve_max_val: bool = struct.field(pytree_node=False, default=False)
    clip: bool = struct.field(pytree_node=False, default=True)
    clip_gradient: bool = struct.field(pytree_node=False, default=False)
    round: bool = struct.field(pytree_node=False, default=True)
    noise_fn: NoiseFn | None = struct.field(pytree_node=False, default=None)
    dtype: Any = struct.field(pytree_node=False, default=None)

    def __post_init__(self) -> None:
        owner = "IntNumerics"
        check_int(owner, "bits", self.bits, 1, 16)
        for name in (
            "preserve_zero",
            "preserve_max_val",
            "clip",
            "clip_gradient",
            "round",
        ):
            check_bool(owner, name, getattr(self, name))
        if self.noise_fn is not None and not callable(self.noise_fn):
            raise InvalidArgumentError(
                owner, "noise_fn", self.noise_fn, "None or a callable(shape, key)"
            )
        if self.bits == 1 and self.preserve_zero:
            raise InvalidArgumentError(
                owner,
                "preserve_zero",
                True,
                "False when bits=1",
                why="a 1-bit grid with an exact zero has a single level, 0; "
                "binary is bits=1, preserve_zero=False",
            )
        object.__setattr__(self, "dtype", self._storage_dtype(self.dtype))

    def _storage_dtype(self, dtype: Any) -> np.dtype | None:
        owner = "IntNumerics"
        integer_grid = self.preserve_zero and self.round
        if dtype is None:
            if not integer_grid:
                return None
            return next(np.dtype(d) for b, d in _STORAGE_BY_BITS if self.bits <= b)
        dt, info = integer_dtype(
            owner, dtype, "None or a signed integer dtype (int4, int8, ..)"
        )
        if info.min >= 0:
            raise InvalidArgumentError(
                owner, "dtype", dt, "a signed integer dtype (the grid is symmetric)"
            )
        if not integer_grid:
            raise InvalidArgumentError(
                owner,
                "dtype",
                dt,
                "None for this grid",
                why="the grid is not integers (it needs preserve_zero=True and "
                "round=True), so no integer dtype stores it",
            )
        top = 2 ** (self.bits - 1) - 1
        if info.max < top:
            raise InvalidArgumentError(
                owner,
                "dtype",
                dt,
                f"a signed integer dtype holding [-{top}, {top}] for bits={self.bits}",
                why=f"{dt} holds [{info.min}, {info.max}]",
            )
        return dt

    def _edge_of_last_bucket(self) -> float:
        edge = 2.0 ** (self.bits - 1)
        return edge - 0.5 if self.preserve_zero else edge

    def _clip_bound(self) -> float:
        # Rounding a value at the bucket edge would reach a bucket that does
        # not exist, so the rounding grid clips half a bucket further in.
        edge = self._edge_of_last_bucket()
        return edge - 0.5 if self.round else edge

    def abs_val_mapped_to(self) -> float:
        """The bucket edge (or centre, with ``preserve_max_val``) of the top bucket."""
        edge = self._edge_of_last_bucket()
        return edge - 0.5 if self.preserve_max_val else edge

    def get_dtype(self) -> np.dtype | None:
        """The integer storage dtype, or ``None`` when the grid is not integers."""
        return self.dtype

    def _check_precision(self, dtype: np.dtype) -> None:
        if not self.round:
            return
        # Largest grid magnitude 2**(bits-1) - 1 (or - 0.5) needs this many
        # significand bits to be exact.
        needed = self.bits - 1 if self.preserve_zero else self.bits
        have = ml_dtypes.finfo(dtype).nmant + 1
        if needed > have:
            raise InvalidArgumentError(
                "IntNumerics",
                "x.dtype",
                dtype,
                f"a float dtype with at least {needed} significand bits (float32)",
                why=f"the {self.bits}-bit grid is not representable in {dtype}",
            )

    def fwd(self, x: jax.Array, context: Context | None) -> jax.Array:
        """Noise (optional), clip (optional), round (optional)."""
        x = check_float_input("IntNumerics", x)
        self._check_precision(x.dtype)
        y = x.astype(compute_dtype(x.dtype))
        if self.noise_fn is not None:
            key = require_key("IntNumerics", context)
            y = y + self.noise_fn(y.shape, key).astype(y.dtype)
        if self.clip:
            # numpy scalars of y's dtype: python floats become float64 arrays
            # in lax.clamp when jax_enable_x64 is on.
            bound = np.asarray(self._clip_bound(), y.dtype)
            y = lax.clamp(-bound, y, bound)
        if self.round:
            if self.preserve_zero:
                y = lax.round(y, lax.RoundingMethod.TO_NEAREST_EVEN)
            else:
                y = jnp.floor(y) + 0.5
        return y.astype(x.dtype)

    def gradient_range(self) -> tuple[float, float]:
        """The clip range (the gradient's mask with ``clip_gradient``)."""
        return (-self._clip_bound(), self._clip_bound())

    @property
    def clips(self) -> bool:
        """``clip``."""
        return self.clip

    @property
    def has_zero(self) -> bool:
        """``False`` for a rounding grid without ``preserve_zero`` (binary)."""
        return self.preserve_zero or not self.round

    @property
    def keeps_zero(self) -> bool:
        """With rounding, ``preserve_zero``; without, when there is no noise."""
        return self.preserve_zero if self.round else self.noise_fn is None

    def code_bound(self) -> int | None:
        """``2**(bits-1) - 1`` for clipped integer codes; ``None`` unclipped."""
        if self.clip and self.dtype is not None:
            return 2 ** (self.bits - 1) - 1
        return None

    def saturation_edge(self) -> float:
        """The edge of the top bucket (127.5 for int8)."""
        return self._edge_of_last_bucket()

    def smallest_nonzero(self) -> float | None:
        """1 on an integer grid (values above 0.5 round to it); else ``None``."""
        return 1.0 if self.round and self.preserve_zero else None

    def unclipped(self) -> IntNumerics | None:
        """Without ``clip``, for stored codes with no noise and no clipped gradient."""
        simple = self.noise_fn is None and not self.clip_gradient
        if self.clip and simple and self.dtype is not None:
            return dataclasses.replace(self, clip=False)
        return None
