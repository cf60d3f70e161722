r"""PTQ methods as values: what :func:`~qbits.ptq.quantize_weights` runs per weight.

A method is a frozen dataclass (its settings are its fields) with one job:
quantize one weight matrix ``(K, N)`` of ``x @ w`` given the statistics of
its activation (:class:`InputStats`) and the weight's quantizer. The driver
does the rest: statistics, layouts, layers and groups, transforms, reports
and stored weights. A method says what it needs and what it works with:

- :attr:`Method.propagated`: it needs the statistics of the activation as
  the model computes it with the weights quantized before this one
  (``X_hat``) beside the float one (``X``): the driver then runs the
  calibration batches again before each weight and fills
  :attr:`InputStats.quantized_hessian` and :attr:`InputStats.cross`;
- :meth:`Method.check`: refuses driver options it cannot work with (AWQ's
  search needs ``mean |x|``, which a rotation does not keep).

A new method is one module: a subclass with a ``name``, its fields and
:meth:`Method.quantize` (and its export in :mod:`qbits.ptq`). Its ``name``
also works as ``method="<name>"`` (the method with its defaults).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

import jax

from qbits._errors import InvalidArgumentError
from qbits._quantizer import Quantizer
from qbits.ptq._stats import InputStats

if TYPE_CHECKING:
    from qbits.ptq._gptq import GptqResult

__all__ = ["Method", "by_name", "method_class", "settings"]

_METHODS: dict[str, type[Method]] = {}


class Method(abc.ABC):
    """A post-training quantization method: a value for ``quantize_weights(method=)``.

    Subclasses are frozen dataclasses whose fields are the method's
    settings (:class:`~qbits.ptq.Rtn`, :class:`~qbits.ptq.Gptq`,
    :class:`~qbits.ptq.Awq`), with a class attribute ``name`` (the
    reports' ``method`` in :attr:`~qbits.ptq.PtqResult.layers`, and
    ``method="<name>"``).

    Attributes:
      name: The method's name.
      propagated: Whether :meth:`quantize` needs the statistics of the
        activation the quantized model computes (:class:`InputStats`'
        ``quantized_hessian`` and ``cross``).

    Example:
      >>> qbits.ptq.Gptq(damping=0.02).name, qbits.ptq.Rtn().propagated
      ('gptq', False)
    """

    name: ClassVar[str]
    propagated: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            _METHODS[cls.name] = cls

    def check(self, owner: str, *, smooth: float | None, rotate: bool) -> None:
        """Raises if the method cannot work with the driver's transforms.

        Args:
          owner: Named in errors.
          smooth: ``quantize_weights``' ``smooth``.
          rotate: ``quantize_weights``' ``rotate``.

        Raises:
          InvalidArgumentError: For a transform it cannot work with.

        Example:
          >>> qbits.ptq.Gptq().check("f", smooth=0.5, rotate=True)  # both fine
        """
        del owner, smooth, rotate  # any transform, by default

    @abc.abstractmethod
    def quantize(
        self, w: jax.Array, stats: InputStats, quantizer: Quantizer
    ) -> GptqResult | jax.Array:
        """Quantizes one weight matrix ``(K, N)`` of ``x @ w``.

        Args:
          w: The weight (after the driver's transforms).
          stats: Its activation's statistics.
          quantizer: The target grid, applied with contracting axis 0.

        Returns:
          A :class:`~qbits.ptq.GptqResult` for a weight on the quantizer's
          grid (its scales: the driver stores it as serving does), or the
          effective float weight (``(K, N)``, ``w``'s dtype) for one that is
          not (AWQ's ``Q(s w) / s``).
        """


def by_name(owner: str, method: Any) -> Method:
    """``method`` as a :class:`Method`: a name stands for its defaults.

    Raises:
      InvalidArgumentError: For neither a method nor a method's name.
    """
    if isinstance(method, Method):
        return method
    if isinstance(method, str) and method in _METHODS:
        return _METHODS[method]()
    names = ", ".join(f"qbits.ptq.{c.__name__}()" for c in _METHODS.values())
    allowed = f"a method ({names}) or its name ({', '.join(map(repr, _METHODS))})"
    raise InvalidArgumentError(owner, "method", method, allowed)


def method_class(name: str) -> type[Method] | None:
    """The method class registered under ``name``, or ``None``."""
    return _METHODS.get(name)


def settings(cls: type[Method]) -> tuple[str, ...]:
    """A method class's settings: its dataclass fields."""
    return tuple(f.name for f in dataclasses.fields(cls))
