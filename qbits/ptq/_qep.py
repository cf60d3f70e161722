r"""QEP: correct each weight for the quantization error in its inputs, then quantize.

Arai and Ichikawa, "Quantization Error Propagation: Revisiting Layer-Wise
Post-Training Quantization" (arXiv 2504.09629). Layer-wise methods (RTN,
GPTQ) fit each quantized layer to the float layer on the float layer's
inputs ``X``; in the quantized model the layer gets ``X_hat``, the output
of the layers before it, quantized. QEP fits the layer's float output on
the inputs it will get:

.. math:: w^* = \arg\min_{w'} \lVert X w - \hat X w' \rVert_F^2
   = w + \hat H^{-1} \hat X^\top (X - \hat X)\, w,
   \qquad \hat H = \hat X^\top \hat X,

relaxed by ``alpha`` (``w + alpha (w^* - w)``: 1 the least-squares fit,
0 no correction) and with ``damping * mean(diag H_hat)`` added to the
diagonal of ``H_hat``, and quantizes ``w^*`` with a layer-wise method on
``H_hat``. The driver gives ``H_hat`` and ``X_hat^T X`` over the
calibration set (:attr:`~qbits.ptq.Method.propagated`), quantizing the
weights in program order.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from qbits._errors import InvalidArgumentError, check_float
from qbits._formats import compute_dtype
from qbits._quantizer import Quantizer
from qbits.ptq._gptq import Gptq, GptqResult
from qbits.ptq._method import Method
from qbits.ptq._stats import InputStats

__all__ = ["Qep"]

_OWNER = "qbits.ptq.Qep"


@dataclasses.dataclass(frozen=True)
class Qep(Method):
    r"""Quantization error propagation (QEP) as a ``quantize_weights`` method.

    Each weight is first corrected for the error that the weights quantized
    before it put into its input, ``w + alpha H_hat^{-1} X_hat^T (X -
    X_hat) w`` (at ``alpha = 1`` the least-squares fit of the float output
    on the quantized input, ``argmin ||X w - X_hat w'||``), then
    quantized by ``then`` on ``H_hat = X_hat^T X_hat``. The driver runs the
    calibration batches before each weight (``fn`` on the float and on the
    partly quantized parameters): ``batches`` must be a list, and
    precomputed ``stats`` do not do. The weights of a scan's stacked layers
    are corrected together. The reports' errors are those of the float
    inputs, as for every method; QEP lowers the error of the model's output.

    Attributes:
      alpha: The correction's strength in [0, 1] (the paper's ``alpha``;
        0.5 by default, as in Qwix).
      damping: The fraction of ``mean(diag H_hat)`` added to its diagonal
        before the solve.
      then: The layer-wise method that quantizes the corrected weight
        (:class:`~qbits.ptq.Gptq`, :class:`~qbits.ptq.Rtn`; not a
        propagated one).

    Raises:
      InvalidArgumentError: For ``alpha`` outside [0, 1], a negative
        ``damping`` or a ``then`` that is not a layer-wise method.

    Example:
      >>> ws = jax.random.normal(jax.random.key(0), (2, 16, 16))
      >>> params = {"w1": ws[0], "w2": ws[1]}
      >>> def mlp(params, x):  # w2 is corrected for w1's error
      ...     return jnp.tanh(x @ params["w1"]) @ params["w2"]
      >>> x = jax.random.normal(jax.random.key(1), (64, 16))
      >>> qep = qbits.ptq.Qep(alpha=1.0)
      >>> out = qbits.ptq.quantize_weights(mlp, params, [x], "int8_fwd", method=qep)
      >>> [r.method for r in out.layers]
      ['qep', 'qep']
    """

    name: ClassVar[str] = "qep"
    propagated: ClassVar[bool] = True
    alpha: float = 0.5
    damping: float = 0.01
    then: Method = dataclasses.field(default_factory=Gptq)

    def __post_init__(self) -> None:
        check_float(_OWNER, "alpha", self.alpha, lo=0.0, hi=1.0)
        check_float(_OWNER, "damping", self.damping, lo=0.0)
        if not isinstance(self.then, Method) or self.then.propagated:
            raise InvalidArgumentError(
                _OWNER, "then", self.then,
                "a layer-wise method: qbits.ptq.Gptq(), qbits.ptq.Rtn()",
            )  # fmt: skip

    def check(self, owner: str, *, smooth: float | None, rotate: bool) -> None:
        """What ``then`` refuses (see :meth:`Method.check`)."""
        self.then.check(owner, smooth=smooth, rotate=rotate)

    def quantize(
        self, w: jax.Array, stats: InputStats, quantizer: Quantizer
    ) -> GptqResult | jax.Array:
        """``then`` on the corrected weight and ``H_hat`` (see :class:`Method`)."""
        if stats.quantized_hessian is None or stats.cross is None:
            raise InvalidArgumentError(
                _OWNER, "stats", "InputStats without quantized_hessian and cross",
                "the statistics quantize_weights gives a propagated method "
                "(X_hat^T X_hat and X_hat^T X)",
            )  # fmt: skip
        corrected, ok = _correct(
            w, stats.quantized_hessian, stats.cross, self.alpha, self.damping
        )
        if not isinstance(ok, jax.core.Tracer) and not bool(ok):
            raise InvalidArgumentError(
                _OWNER, "damping", self.damping,
                f"a larger damping (e.g. {max(10 * self.damping, 0.01):g})",
                why="X_hat^T X_hat of this layer is not positive definite after "
                "damping",
            )  # fmt: skip
        stats = dataclasses.replace(stats, hessian=stats.quantized_hessian)
        return self.then.quantize(corrected, stats, quantizer)


@jax.jit
def _correct(
    w: jax.Array, h_hat: jax.Array, cross: jax.Array, alpha: float, damping: float
) -> tuple[jax.Array, jax.Array]:
    """``(w + alpha H_hat^{-1} (cross - H_hat) w, whether the solve is finite)``."""
    dtype = compute_dtype(w.dtype)
    h, c, wf = h_hat.astype(dtype), cross.astype(dtype), w.astype(dtype)
    k = h.shape[0]
    diag = jnp.diagonal(h)
    # A channel X_hat never fires: no equation for it (its row of cross - H
    # is zero, so its weight row is left as it is).
    eye = jnp.eye(k, dtype=dtype)
    damped = h + eye * ((diag == 0).astype(dtype) + damping * jnp.mean(diag))
    factor = jax.scipy.linalg.cho_factor(damped, lower=True)
    rhs = jnp.matmul(c - h, wf, precision=lax.Precision.HIGHEST)
    delta = jax.scipy.linalg.cho_solve(factor, rhs)
    ok = jnp.all(jnp.isfinite(delta))
    return (wf + alpha * delta).astype(w.dtype), ok
