"""Which elements share a scale: per tensor, per channel, or in tiles.

A granularity gives, for a tensor shape, the *block size* along every axis:
the whole axis (the scale is shared along it), 1 (one scale per index: per
channel), or a tile size in between (one scale per tile). Scales then have
one entry per block: ``scale.shape[a] == shape[a] // block[a]``, which is how
:class:`~qbits.QTensor` stores them.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any

from flax import struct

from qbits.errors import InvalidArgumentError, check_int, normalize_axis

__all__ = ["BlockLayout", "Granularity", "PerChannel", "PerTensor", "Tiled"]


def _axes_tuple(owner: str, argument: str, axes: Any) -> tuple[int, ...]:
    if isinstance(axes, int) and not isinstance(axes, bool):
        axes = (axes,)
    ok = isinstance(axes, Sequence) and not isinstance(axes, str)
    ok = ok and all(isinstance(a, int) and not isinstance(a, bool) for a in axes)
    if not ok:
        raise InvalidArgumentError(owner, argument, axes, "an int or a tuple of ints")
    return tuple(axes)


def _normalize(owner: str, argument: str, axes: tuple[int, ...], ndim: int) -> set[int]:
    out = {normalize_axis(owner, argument, a, ndim) for a in axes}
    if len(out) != len(axes):
        raise InvalidArgumentError(owner, argument, axes, "distinct axes")
    return out


class Granularity(struct.PyTreeNode, metaclass=abc.ABCMeta):
    """Maps a tensor shape to the block size along each axis.

    Example:
      Blocks of 2x2:

      >>> class Squares(qbits.Granularity):
      ...     def block_sizes(self, shape):
      ...         return (2,) * len(shape)
      >>> import jax.numpy as jnp
      >>> q = qbits.Quantizer(qbits.IntNumerics(bits=8), granularity=Squares())
      >>> q.quant(jnp.ones((4, 6))).scale.shape
      (2, 3)
    """

    @abc.abstractmethod
    def block_sizes(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The block size along each axis of ``shape``.

        Raises:
          InvalidArgumentError: If the granularity does not fit ``shape``.
        """


class PerTensor(Granularity):
    """One scale for the whole tensor.

    Example:
      >>> qbits.PerTensor().block_sizes((4, 6))
      (4, 6)
    """

    def block_sizes(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The whole shape."""
        return tuple(shape)


class PerChannel(Granularity):
    """Scales shared over ``shared_axes``, one per index of the other axes.

    For a matmul operand, share the scale over the contracting axes: it then
    factors out of the dot.

    Attributes:
      shared_axes: The axes the scale is shared over (negative allowed).

    Example:
      >>> qbits.PerChannel(shared_axes=(0,)).block_sizes((4, 6))
      (4, 1)
    """

    shared_axes: tuple[int, ...] = struct.field(pytree_node=False, default=(0,))

    def __post_init__(self) -> None:
        axes = _axes_tuple("PerChannel", "shared_axes", self.shared_axes)
        object.__setattr__(self, "shared_axes", axes)

    def block_sizes(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The full size along shared axes, 1 along the others."""
        shared = _normalize("PerChannel", "shared_axes", self.shared_axes, len(shape))
        return tuple(n if a in shared else 1 for a, n in enumerate(shape))


class Tiled(Granularity):
    """Tiles of ``tile_size`` along ``axis``, one scale per tile (subchannel).

    Along ``shared_axes`` the scale is shared as well; along every other axis
    there is one scale per index. MX formats are tiles of 32 along the
    contracting axis with power-of-two (E8M0) scales.

    Attributes:
      axis: The tiled axis (negative allowed).
      tile_size: Elements per tile; must divide the axis.
      shared_axes: Further axes the scale is shared over.

    Example:
      >>> qbits.Tiled(axis=1, tile_size=32).block_sizes((4, 128))
      (1, 32)
      >>> qbits.Tiled(axis=-1, tile_size=3).block_sizes((4, 128))
      Traceback (most recent call last):
      ...
      qbits.errors.InvalidArgumentError: Tiled: tile_size=3 is not allowed
      (axis 1 has size 128); expected a divisor of 128: 1, 2, 4, 8, 16, 32, 64, 128.
    """

    axis: int = struct.field(pytree_node=False, default=-1)
    tile_size: int = struct.field(pytree_node=False, default=32)
    shared_axes: tuple[int, ...] = struct.field(pytree_node=False, default=())

    def __post_init__(self) -> None:
        check_int("Tiled", "axis", self.axis)
        check_int("Tiled", "tile_size", self.tile_size, 1)
        axes = _axes_tuple("Tiled", "shared_axes", self.shared_axes)
        object.__setattr__(self, "shared_axes", axes)

    def block_sizes(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """``tile_size`` along ``axis``, full along shared axes, else 1."""
        ndim = len(shape)
        axis = normalize_axis("Tiled", "axis", self.axis, ndim)
        shared = _normalize("Tiled", "shared_axes", self.shared_axes, ndim)
        if axis in shared:
            raise InvalidArgumentError(
                "Tiled",
                "shared_axes",
                self.shared_axes,
                f"axes other than the tiled axis {self.axis}",
            )
        n = shape[axis]
        if n % self.tile_size:
            divisors = [d for d in range(1, n + 1) if n % d == 0]
            raise InvalidArgumentError(
                "Tiled",
                "tile_size",
                self.tile_size,
                f"a divisor of {n}: "
                + ", ".join(map(str, divisors[:16]))
                + (", ..." if len(divisors) > 16 else ""),
                why=f"axis {axis} has size {n}",
            )
        return tuple(
            self.tile_size if a == axis else (m if a in shared else 1)
            for a, m in enumerate(shape)
        )


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """How a tensor is reshaped so that each scale block is a set of axes.

    Axes whose block is neither 1 nor the whole axis are split into
    ``(n // block, block)``. Reducing the blocked tensor over
    ``reduce_axes`` (keepdims) gives one value per block; reshaping that to
    ``scale_shape`` gives the scale layout of :class:`~qbits.QTensor`.

    Attributes:
      blocked_shape: The shape with tiled axes split.
      reduce_axes: Axes of ``blocked_shape`` that a block spans.
      scale_shape: One entry per block, same rank as the tensor.
    """

    blocked_shape: tuple[int, ...]
    reduce_axes: tuple[int, ...]
    scale_shape: tuple[int, ...]

    @classmethod
    def create(cls, shape: tuple[int, ...], blocks: tuple[int, ...]) -> BlockLayout:
        """The layout of ``shape`` cut into blocks of size ``blocks``."""
        blocked: list[int] = []
        reduce: list[int] = []
        scale: list[int] = []
        for n, b in zip(shape, blocks, strict=True):
            if b == 1 or b == n:
                if b == n:
                    reduce.append(len(blocked))
                blocked.append(n)
                scale.append(n // b)
            else:
                blocked.extend((n // b, b))
                reduce.append(len(blocked) - 1)
                scale.append(n // b)
        return cls(tuple(blocked), tuple(reduce), tuple(scale))
