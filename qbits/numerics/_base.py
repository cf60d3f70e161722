"""The QNumerics interface and the custom VJP that every numerics gets."""

from __future__ import annotations

import abc
import functools
from typing import Any, ClassVar, Protocol

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import struct

from qbits._context import Context
from qbits._errors import InvalidArgumentError
from qbits.numerics._keys import check_key

__all__ = ["NoiseFn", "QNumerics"]

Residuals = Any


class NoiseFn(Protocol):
    """Draws rounding noise, uniform in ``[-0.5, 0.5)``, for a given shape."""

    def __call__(self, shape: tuple[int, ...], key: jax.Array) -> jax.Array:
        """Returns float32 noise of ``shape`` drawn from ``key``."""
        ...


class QNumerics(struct.PyTreeNode, metaclass=abc.ABCMeta):
    """How a real number (already divided by its scale) becomes a grid point.

    A numerics object is a frozen, hashable pytree with only static fields. It
    owns its gradient: calling it (``numerics(x, context)``) runs :meth:`fwd`
    in the forward pass and :meth:`vjp_bwd` in the backward pass, through a
    ``jax.custom_vjp``. Subclasses implement the abstract methods; a grid
    that stores codes, clips or has no zero also says so through the
    properties and methods below the abstract ones (:attr:`asymmetric`,
    :attr:`codebook`, :attr:`clips`, :meth:`code_bound`, ...), whose
    defaults describe a grid for fake quantization only. Nothing outside
    the numerics asks which class a numerics is.

    Example:
      A sign (binary) numerics with a straight-through gradient:

      >>> import jax, jax.numpy as jnp
      >>> class Sign(qbits.numerics.QNumerics):
      ...     def fwd(self, x, context):
      ...         return jnp.where(x < 0, -1.0, 1.0).astype(x.dtype)
      ...     def vjp_fwd(self, x, context):
      ...         return self.fwd(x, context), None
      ...     def vjp_bwd(self, residuals, g):
      ...         return g, None
      ...     def get_dtype(self):
      ...         return None
      ...     def abs_val_mapped_to(self):
      ...         return 1.0
      >>> Sign()(jnp.array([-2.0, 0.5]))
      Array([-1.,  1.], dtype=float32)
      >>> jax.grad(lambda x: Sign()(x).sum())(jnp.array([-2.0, 0.5]))
      Array([1., 1.], dtype=float32)
    """

    @abc.abstractmethod
    def fwd(self, x: jax.Array, context: Context | None) -> jax.Array:
        """Puts ``x`` on the grid. Returns an array of ``x``'s dtype and shape."""

    @abc.abstractmethod
    def vjp_fwd(
        self, x: jax.Array, context: Context | None
    ) -> tuple[jax.Array, Residuals]:
        """Forward pass of the custom VJP: ``(fwd(x, context), residuals)``."""

    @abc.abstractmethod
    def vjp_bwd(self, residuals: Residuals, g: jax.Array) -> tuple[jax.Array, None]:
        """Backward pass: cotangents for ``(x, context)`` given ``g``."""

    @abc.abstractmethod
    def get_dtype(self) -> np.dtype | None:
        """Storage dtype of the real (non-emulated) path; ``None`` if none."""

    @abc.abstractmethod
    def abs_val_mapped_to(self) -> float | None:
        """The grid magnitude that the calibration bound is mapped onto."""

    def __call__(self, x: jax.Array, context: Context | None = None) -> jax.Array:
        """Applies the numerics with its own gradient (see :meth:`vjp_bwd`)."""
        return _apply(self, x, context)

    # What the rest of qbits asks a grid (quantizer, storage, serving, the
    # matmuls' accumulators, caches): each numerics answers for itself, with
    # these defaults for a fake-quantization grid that stores nothing. A
    # subclass sets a flag as a class attribute, or as a property when its
    # fields decide it.

    #: Whether this numerics quantizes nothing (:class:`NoNumerics`).
    is_identity: ClassVar[bool] = False
    #: Whether the grid is unsigned codes with a zero point per block: a
    #: :class:`~qbits.Quantizer` then maps each block's range onto the codes
    #: ``0 .. abs_val_mapped_to()`` through a scale and a zero point
    #: (:class:`UintNumerics`).
    asymmetric: ClassVar[bool] = False
    #: Whether the input is clipped to ``gradient_range()``, every output in it.
    clips: ClassVar[bool] = False
    #: Whether 0 is a grid point (a grid of signs, like binary, has none).
    has_zero: ClassVar[bool] = True
    #: Whether 0 comes back exactly 0, whatever the noise.
    keeps_zero: ClassVar[bool] = False

    @property
    def codebook(self) -> tuple[float, ...] | None:
        """The values that stored codes stand for, or ``None`` (codes are values)."""
        return None

    def code_bound(self) -> int | None:
        """The largest magnitude of the integer codes stored, if below the dtype's.

        ``None``: any value of the storage dtype. Stored matmuls sum products
        of codes in int32 where ``K * bound * bound`` fits (an int8 grid
        clipped at 127, not the dtype's -128).
        """
        return None

    def saturation_edge(self) -> float | None:
        """``|x|`` beyond which an input saturates (the top bucket's far edge)."""
        return self.abs_val_mapped_to()

    def smallest_nonzero(self) -> float | None:
        """The smallest magnitude a nonzero grid point has; ``None`` if unknown."""
        return None

    def unclipped(self) -> QNumerics | None:
        """This numerics without its clip, where clipping first is the same.

        Where the quantizer may clip the input to :meth:`gradient_range` itself
        and then apply the result, with the same values and gradient (the
        clip commutes with what the numerics does before it, and the gradient
        does not look at it); ``None`` elsewhere. The quantizer does so on a
        GPU for stored integer codes, so that each quantization of a tensor
        gets its own chain of operations, laid out for its own GEMM.
        """
        return None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _apply(numerics: QNumerics, x: jax.Array, context: Context | None) -> jax.Array:
    return numerics.fwd(x, context)


def _apply_fwd(
    numerics: QNumerics, x: jax.Array, context: Context | None
) -> tuple[jax.Array, Residuals]:
    return numerics.vjp_fwd(x, context)


def _apply_bwd(
    numerics: QNumerics, residuals: Residuals, g: jax.Array
) -> tuple[jax.Array, None]:
    return numerics.vjp_bwd(residuals, g)


_apply.defvjp(_apply_fwd, _apply_bwd)


class ClippedStraightThrough(QNumerics):
    """Numerics whose gradient is straight-through, masked with ``clip_gradient``.

    Subclasses have a ``clip_gradient`` field and say where their grid ends
    (:meth:`gradient_range`): with ``clip_gradient`` the gradient is zero for
    inputs outside it (they clipped), else it passes everywhere.
    """

    @abc.abstractmethod
    def gradient_range(self) -> tuple[float, float]:
        """The inputs ``[lo, hi]`` whose gradient passes with ``clip_gradient``."""

    def vjp_fwd(
        self, x: jax.Array, context: Context | None
    ) -> tuple[jax.Array, jax.Array | None]:
        """Forward pass; keeps ``x`` only when the gradient needs its mask."""
        return self.fwd(x, context), (x if self.clip_gradient else None)  # type: ignore[attr-defined]

    def vjp_bwd(
        self, residuals: jax.Array | None, g: jax.Array
    ) -> tuple[jax.Array, None]:
        """Straight-through; zero outside :meth:`gradient_range` when masked."""
        if residuals is None:
            return g, None
        lo, hi = (np.asarray(v, residuals.dtype) for v in self.gradient_range())
        inside = (residuals >= lo) & (residuals <= hi)
        return jnp.where(inside, g, jnp.zeros_like(g)), None


def require_key(owner: str, context: Context | None) -> jax.Array:
    """Returns the context's PRNG key, checked (:func:`check_key`).

    Raises:
      InvalidArgumentError: When it is absent or not one key.
    """
    key = None if context is None else context.key
    if key is None:
        raise InvalidArgumentError(
            owner,
            "context",
            context,
            "a qbits.numerics.Context(key=jax.random.key(...)): this numerics rounds "
            "stochastically (noise_fn is set) and draws its noise from that key",
        )
    return check_key(owner, key)


def integer_dtype(owner: str, dtype: Any, allowed: str) -> tuple[np.dtype, Any]:
    """``dtype`` as a NumPy dtype, and its ``ml_dtypes.iinfo``.

    Raises:
      InvalidArgumentError: If ``dtype`` is not an integer dtype (``allowed``
        says what is).
    """
    try:
        dt = np.dtype(dtype)
        return dt, ml_dtypes.iinfo(dt)
    except (TypeError, ValueError):
        raise InvalidArgumentError(owner, "dtype", dtype, allowed) from None
