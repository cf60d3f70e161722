"""Which elements share a scale: per tensor, per channel, or in tiles.

A granularity gives, for a tensor shape, the *block size* along every axis:
the whole axis (the scale is shared along it), 1 (one scale per index: per
channel), or a tile size in between (one scale per tile). Scales then have
one entry per block: ``scale.shape[a] == shape[a] // block[a]``, which is how
:class:`~qbits.QTensor` stores them.

For a matmul operand, axes can be left to the matmul: ``PerChannel()`` shares
the scale over the operand's contracting axes, so it factors out of the dot,
and ``Tiled(tile_size=32)`` tiles the contracting axis. Quantizing a tensor on
its own then needs explicit axes.
"""

from __future__ import annotations

import abc
import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

from flax import struct

from qbits._errors import InvalidArgumentError, check_int, normalize_axis

__all__ = ["BlockLayout", "Granularity", "PerChannel", "PerTensor", "Tiled"]

Axes = tuple[int, ...]


def _axes_tuple(owner: str, argument: str, axes: Any) -> Axes | None:
    if axes is None:
        return None
    if isinstance(axes, int) and not isinstance(axes, bool):
        axes = (axes,)
    ok = isinstance(axes, Sequence) and not isinstance(axes, str)
    ok = ok and all(isinstance(a, int) and not isinstance(a, bool) for a in axes)
    if not ok:
        raise InvalidArgumentError(
            owner,
            argument,
            axes,
            "None (the contracting axes), an int or a tuple of ints",
        )
    return tuple(axes)


def _normalize(owner: str, argument: str, axes: Axes, ndim: int) -> set[int]:
    out = {normalize_axis(owner, argument, a, ndim) for a in axes}
    if len(out) != len(axes):
        raise InvalidArgumentError(owner, argument, axes, "distinct axes")
    return out


def _contracting(owner: str, argument: str, contracting: Axes | None) -> Axes:
    if contracting is None:
        raise InvalidArgumentError(
            owner,
            argument,
            None,
            "explicit axes when quantizing outside a matmul (None means the "
            "contracting axes, which only a matmul knows)",
        )
    return contracting


class Granularity(struct.PyTreeNode, metaclass=abc.ABCMeta):
    """Maps a tensor shape to the block size along each axis.

    Example:
      Blocks of 2x2:

      >>> class Squares(qbits.Granularity):
      ...     def block_sizes(self, shape, contracting_axes=None):
      ...         return (2,) * len(shape)
      >>> import jax.numpy as jnp
      >>> q = qbits.Quantizer(qbits.IntNumerics(bits=8), granularity=Squares())
      >>> q.quant(jnp.ones((4, 6))).scale.shape
      (2, 3)
    """

    @abc.abstractmethod
    def block_sizes(
        self, shape: tuple[int, ...], contracting_axes: Axes | None = None
    ) -> tuple[int, ...]:
        """The block size along each axis of ``shape``.

        Args:
          shape: The tensor's shape.
          contracting_axes: The axes a matmul contracts (non-negative), or
            ``None`` outside a matmul.

        Raises:
          InvalidArgumentError: If the granularity does not fit ``shape``.
        """


class PerTensor(Granularity):
    """One scale for the whole tensor.

    Example:
      >>> qbits.PerTensor().block_sizes((4, 6))
      (4, 6)
    """

    def block_sizes(
        self, shape: tuple[int, ...], contracting_axes: Axes | None = None
    ) -> tuple[int, ...]:
        """The whole shape."""
        return tuple(shape)


class PerChannel(Granularity):
    """Scales shared over ``shared_axes``, one per index of the other axes.

    The default, ``shared_axes=None``, shares the scale over a matmul
    operand's contracting axes (one scale per row of the activations, per
    output channel of the weights), so it factors out of the dot: AQT's
    default.

    Attributes:
      shared_axes: The axes the scale is shared over (negative allowed), or
        ``None`` for the contracting axes.

    Example:
      >>> qbits.PerChannel(shared_axes=(0,)).block_sizes((4, 6))
      (4, 1)
      >>> qbits.PerChannel().block_sizes((4, 6), contracting_axes=(1,))
      (1, 6)
    """

    shared_axes: Axes | None = struct.field(pytree_node=False, default=None)

    def __post_init__(self) -> None:
        axes = _axes_tuple("PerChannel", "shared_axes", self.shared_axes)
        object.__setattr__(self, "shared_axes", axes)

    def block_sizes(
        self, shape: tuple[int, ...], contracting_axes: Axes | None = None
    ) -> tuple[int, ...]:
        """The full size along shared axes, 1 along the others."""
        axes = self.shared_axes
        if axes is None:
            axes = _contracting("PerChannel", "shared_axes", contracting_axes)
        shared = _normalize("PerChannel", "shared_axes", axes, len(shape))
        return tuple(n if a in shared else 1 for a, n in enumerate(shape))


class Tiled(Granularity):
    """Tiles of ``tile_size`` along ``axis``, one scale per tile (subchannel).

    Along ``shared_axes`` the scale is shared as well; along every other axis
    there is one scale per index. MX formats are tiles of 32 along the
    contracting axis with power-of-two (E8M0) scales.

    Attributes:
      axis: The tiled axis (negative allowed); ``None`` for a matmul
        operand's contracting axis, the last one the matmul lists when it
        has several (the scale is then shared along the others, by
        default): a dot's weight gradient contracting ``[batch, seq]`` is
        tiled along ``seq``, a convolution along its feature axis.
      tile_size: Elements per tile; must divide the axis.
      shared_axes: Further axes the scale is shared over; ``None`` for a
        matmul operand's other contracting axes (none outside a matmul).
      free_tile_size: Tiles of this size along every other axis as well (1:
        one scale per index). ``Tiled(tile_size=128, free_tile_size=128)``
        gives a weight DeepSeek-V3's 128 x 128 blocks. Must divide those
        axes.

    Example:
      >>> qbits.Tiled(axis=1, tile_size=32).block_sizes((4, 128))
      (1, 32)
      >>> qbits.Tiled(tile_size=32).block_sizes((128, 4), contracting_axes=(0,))
      (32, 1)
      >>> qbits.Tiled(axis=0, tile_size=128, free_tile_size=128).block_sizes(
      ...     (256, 512))
      (128, 128)
      >>> qbits.Tiled(axis=-1, tile_size=3).block_sizes((4, 128))
      Traceback (most recent call last):
      ...
      qbits.InvalidArgumentError: Tiled: tile_size=3 is not allowed
      (axis 1 has size 128); expected a divisor of 128: 1, 2, 4, 8, 16, 32, 64, 128;
      or make that axis a multiple of 3.
    """

    axis: int | None = struct.field(pytree_node=False, default=None)
    tile_size: int = struct.field(pytree_node=False, default=32)
    shared_axes: Axes | None = struct.field(pytree_node=False, default=None)
    free_tile_size: int = struct.field(pytree_node=False, default=1)

    def __post_init__(self) -> None:
        if self.axis is not None:
            check_int("Tiled", "axis", self.axis)
        check_int("Tiled", "tile_size", self.tile_size, 1)
        check_int("Tiled", "free_tile_size", self.free_tile_size, 1)
        axes = _axes_tuple("Tiled", "shared_axes", self.shared_axes)
        object.__setattr__(self, "shared_axes", axes)

    def block_sizes(
        self, shape: tuple[int, ...], contracting_axes: Axes | None = None
    ) -> tuple[int, ...]:
        """``tile_size`` along ``axis``, full along shared axes, else 1."""
        ndim = len(shape)
        if self.axis is None:
            contracting = _contracting("Tiled", "axis", contracting_axes)
            if not contracting:
                raise InvalidArgumentError(
                    "Tiled",
                    "axis",
                    None,
                    "an explicit axis",
                    why="the operand has no contracting axis to tile",
                )
            # The last contracting axis; the scale is shared along the others
            # (a weight gradient over [batch, seq]: tiles along seq).
            axis = contracting[-1] % ndim
        else:
            axis = normalize_axis("Tiled", "axis", self.axis, ndim)
        if self.shared_axes is not None:
            shared = _normalize("Tiled", "shared_axes", self.shared_axes, ndim)
        else:
            shared = set(contracting_axes or ()) - {axis}
        if axis in shared:
            raise InvalidArgumentError(
                "Tiled",
                "shared_axes",
                self.shared_axes,
                f"axes other than the tiled axis {axis}",
            )
        _check_divides("tile_size", self.tile_size, shape, axis)
        free = [a for a in range(ndim) if a != axis and a not in shared]
        for a in free:
            _check_divides("free_tile_size", self.free_tile_size, shape, a)
        return tuple(
            self.tile_size if a == axis else (m if a in shared else self.free_tile_size)
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
        """The layout of ``shape`` cut into blocks of size ``blocks``.

        An axis of size 0 is fine: shared (block 0), it gets one scale entry;
        per index or tiled, none.

        Raises:
          InvalidArgumentError: If ``blocks`` has another length than
            ``shape`` or a block size that does not divide its axis.

        Example:
          >>> qbits._granularity.BlockLayout.create((0, 8), (0, 8)).scale_shape
          (1, 1)
          >>> qbits._granularity.BlockLayout.create((0, 8), (1, 8)).scale_shape
          (0, 1)
        """
        shape, blocks = tuple(shape), tuple(blocks)
        if len(blocks) != len(shape) or not all(map(_fits, shape, blocks)):
            raise InvalidArgumentError(
                "Granularity",
                "block_sizes",
                blocks,
                f"one block size per axis of {shape}, each dividing its axis",
            )
        blocked: list[int] = []
        reduce: list[int] = []
        scale: list[int] = []
        for n, b in zip(shape, blocks, strict=True):
            if b == 1 or b == n:
                if b == n:
                    reduce.append(len(blocked))
                blocked.append(n)
                scale.append(1 if b == n else n)
            else:
                blocked.extend((n // b, b))
                reduce.append(len(blocked) - 1)
                scale.append(n // b)
        return cls(tuple(blocked), tuple(reduce), tuple(scale))

    @property
    def reduced_shape(self) -> tuple[int, ...]:
        """``blocked_shape`` reduced over ``reduce_axes`` (kept with size 1)."""
        return tuple(
            1 if a in self.reduce_axes else n for a, n in enumerate(self.blocked_shape)
        )


def _fits(n: int, block: Any) -> bool:
    """Whether ``block`` is a block size for an axis of size ``n``."""
    try:
        b = operator.index(block)
    except TypeError:
        return False
    return b >= 0 if n == 0 else 1 <= b <= n and n % b == 0


def _check_divides(name: str, size: int, shape: tuple[int, ...], axis: int) -> None:
    n = shape[axis]
    if n % size:
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        raise InvalidArgumentError(
            "Tiled",
            name,
            size,
            f"a divisor of {n}: "
            + ", ".join(map(str, divisors[:16]))
            + (", ..." if len(divisors) > 16 else "")
            + f"; or make that axis a multiple of {size}",
            why=f"axis {axis} has size {n}",
        )
