"""Per-layer, per-operand quantization metrics of a function's matmuls."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qbits import ops, transform
from qbits._errors import InvalidArgumentError
from qbits.diagnostics._loops import into_while

__all__ = ["Metrics", "diagnose", "init", "read"]

_DIAGNOSE = transform._Caller("qbits.diagnostics.diagnose")
_INIT = transform._Caller("qbits.diagnostics.init")


@dataclasses.dataclass(frozen=True)
class Metrics:
    """The quantization metrics of every quantized operand of every matmul.

    ``values[path][operand][metric]`` is a NumPy array shaped like the
    matmul's layer axes (``()`` for a matmul outside a scan, ``(L,)`` for
    one in a scan over ``L`` stacked layers). Operands (the quantized
    tensors of a matmul's three contractions):

    - ``fwd.lhs``, ``fwd.rhs``: the forward operands (activation, weight);
    - ``dlhs.grad``, ``dlhs.rhs``: the output gradient and the weight, as
      the input-gradient matmul quantizes them;
    - ``drhs.grad``, ``drhs.lhs``: the output gradient and the activation,
      as the weight-gradient matmul quantizes them.

    Metrics (``qbits.ops._diagnose`` defines each exactly):
    ``sqnr_db`` (signal to quantization noise, capped at 150 dB where
    nothing is lost), ``clipped`` and ``flushed`` (fractions of the values
    saturated at the grid's top, and of the nonzero values rounded to 0),
    ``wasted_bits`` (the grid's range the scale leaves unused, mean over
    blocks), ``log2_scale_min``, ``log2_scale_max``, and ``nonfinite``
    (the number of values that are NaN or +-inf). An operand that is not
    quantized, not computed (the input gradient of the first layer) or all
    zeros has NaN; one with a value that is not finite has NaN for every
    metric but ``nonfinite`` (:meth:`table` shows ``non-finite``).

    Example:
      >>> def mlp(params, x):
      ...     return jnp.sum(jax.nn.relu(x @ params["w1"]) @ params["w2"])
      >>> params = {"w1": jnp.ones((4, 8)), "w2": jnp.ones((8, 2))}
      >>> x = jax.random.normal(jax.random.key(0), (16, 4))
      >>> _, metrics = qbits.diagnostics.diagnose(mlp, "int8_fwd")(params, x)
      >>> metrics.operands
      ('fwd.lhs', 'fwd.rhs')
      >>> print(metrics.table())  # doctest: +NORMALIZE_WHITESPACE
      | sqnr_db | fwd.lhs | fwd.rhs |
      |---|---|---|
      | w1 | 47.4 | 48.1 |
      | w2 | 48.1 | 48.1 |
    """

    values: Mapping[str, Mapping[str, Mapping[str, np.ndarray]]]

    @property
    def operands(self) -> tuple[str, ...]:
        """The operands measured in at least one matmul, in matmul order."""
        seen = [
            op
            for by_op in self.values.values()
            for op, m in by_op.items()
            if not np.all(np.isnan(m["sqnr_db"])) or _nonfinite(m).any()
        ]
        order = next(iter(self.values.values()), {})
        return tuple(op for op in order if op in seen)

    def layers(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(path, layer index)`` of each matmul, one per layer of a scan."""
        out = []
        for path, by_op in self.values.items():
            shape = np.shape(next(iter(by_op.values()))["sqnr_db"])
            out += [(path, idx) for idx in np.ndindex(*shape)]
        return out

    @staticmethod
    def label(path: str, index: tuple[int, ...]) -> str:
        """``path``, with the layer index of a scanned matmul: ``blocks/fc1[3]``."""
        return path + "".join(f"[{i}]" for i in index)

    def rows(self) -> list[dict[str, Any]]:
        """One flat record per measured operand of each matmul (and layer).

        ``{"matmul": label, "operand": ..., "sqnr_db": ..., ...}`` with plain
        floats (NaN for what was not measured): for CSV and JSON.
        """
        out = []
        for path, index in self.layers():
            for op in self.operands:
                m = self.values[path][op]
                row: dict[str, Any] = {"matmul": self.label(path, index), "operand": op}
                row.update({k: float(np.asarray(v)[index]) for k, v in m.items()})
                out.append(row)
        return out

    def table(self, metric: str = "sqnr_db", digits: int = 1) -> str:
        """A markdown table of ``metric``: a row per matmul, a column per operand.

        A matmul in a scan over stacked layers has a row per layer. A cell
        is empty where the operand is not measured, and reads
        ``non-finite`` where it holds a NaN or an inf (its metrics are
        NaN; ``table("nonfinite")`` gives how many values).

        Raises:
          InvalidArgumentError: For an unknown metric.
        """
        names = tuple(next(iter(next(iter(self.values.values())).values())))
        if metric not in names:
            raise InvalidArgumentError(
                "Metrics.table", "metric", metric, "one of " + ", ".join(names)
            )
        ops_ = self.operands
        lines = [
            f"| {metric} | " + " | ".join(ops_) + " |",
            "|---" * (len(ops_) + 1) + "|",
        ]
        for path, index in self.layers():
            cells = []
            for op in ops_:
                m = self.values[path][op]
                v = float(np.asarray(m[metric])[index])
                if metric != "nonfinite" and _nonfinite(m)[index]:
                    cells.append("non-finite")
                else:
                    cells.append("" if math.isnan(v) else f"{v:.{digits}f}")
            lines.append(f"| {self.label(path, index)} | " + " | ".join(cells) + " |")
        return "\n".join(lines)


def _is_loss(out: Any) -> bool:
    """Whether ``fn``'s output (or its shape) is a float scalar: a loss."""
    return (
        isinstance(out, jax.Array | jax.ShapeDtypeStruct)
        and out.shape == ()
        and jnp.issubdtype(out.dtype, jnp.floating)
    )


def _stuck_message(tree: Any, stuck: list[bool], n_params: int) -> str:
    """What a while_loop keeps :func:`diagnose` from measuring, or ``""``."""
    probes = tree.unflatten(stuck)[1]
    lost = [path for path, p in probes.items() if any(jax.tree.leaves(p))]
    frozen = sum(stuck[:n_params])  # (a loss's: others are not differentiated)
    said = []
    if lost:
        said.append(
            f"not measured (metrics NaN): {', '.join(map(repr, lost))}, whose "
            "probes flow into it"
        )
    if frozen:
        said.append(
            f"not differentiated: the {frozen} (of {n_params}) parameter arrays "
            "that flow into it, so the backward operands that need their "
            "gradient are not measured"
        )
    if not said:
        return ""
    return (
        f"{_DIAGNOSE.owner}: fn runs a lax.while_loop (or a fori_loop with "
        "traced bounds), which reverse-mode differentiation, how diagnostics "
        f"are read, cannot pass: {'; '.join(said)}. To measure them, loop with "
        "lax.scan or a fori_loop with static bounds"
    )


def _nonfinite(metrics: Mapping[str, Any]) -> np.ndarray:
    """Where an operand holds a NaN or an inf (``False`` without the count)."""
    found = np.asarray(metrics.get("nonfinite", 0.0)) > 0
    return np.broadcast_to(found, np.shape(metrics["sqnr_db"]))


def read(grads: Mapping[str, Any]) -> Metrics:
    """The :class:`Metrics` from the gradient with respect to the probes.

    Args:
      grads: ``{matmul path: probe gradient}``: the gradient, with respect
        to :func:`init`'s probes, of a function quantized with
        ``qbits.quantize(..., diagnostics=probes)``.

    Example:
      >>> def f(params, x):
      ...     return jnp.sum(x @ params["w"])
      >>> params, x = {"w": jnp.ones((4, 2))}, jnp.ones((3, 4))
      >>> probes = qbits.diagnostics.init(f, "fp8", params, x)
      >>> def loss(params, probes):
      ...     return qbits.quantize(f, "fp8", diagnostics=probes)(params, x)
      >>> grads, raw = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, probes)
      >>> float(qbits.diagnostics.read(raw).values["w"]["fwd.rhs"]["clipped"])
      0.0

    Raises:
      InvalidArgumentError: For anything else than ``{path: probe
        gradient}`` (e.g. the parameters' gradient, or one probe's
        gradient without its path), naming the path of a wrong entry.
    """
    owner, why = (
        "qbits.diagnostics.read",
        (
            "grads is the gradient with respect to the probes of "
            "qbits.diagnostics.init, passed as qbits.quantize(..., diagnostics=probes)"
        ),
    )
    if not isinstance(grads, Mapping) or not all(isinstance(p, str) for p in grads):
        shown = jax.tree.map(lambda x: getattr(x, "shape", x), grads)
        raise InvalidArgumentError(
            owner, "grads", shown, "{matmul path: probe gradient}", why=why
        )
    values = {}
    for path, raw in grads.items():
        try:
            metrics = ops._read_probe(raw)
        except InvalidArgumentError as e:
            raise InvalidArgumentError(
                owner, f"grads[{path!r}]", e.value, e.allowed, why=why
            ) from None
        values[path] = {
            op: {k: np.asarray(v) for k, v in by_metric.items()}
            for op, by_metric in metrics.items()
        }
    return Metrics(values)


def init(
    fn: Callable[..., Any],
    config: Any,
    *args: Any,
    params_argnum: int | None = 0,
    **kwargs: Any,
) -> dict[str, dict[str, jax.Array]]:
    """The probes of every quantized matmul of ``fn(*args, **kwargs)``.

    What ``qbits.quantize(fn, config, diagnostics=...)`` takes: zeros,
    ``{matmul path: probe}``, stacked along a scan over stacked layers.
    Only traced (abstract ``jax.ShapeDtypeStruct`` arguments are fine).

    Args:
      fn: The function, as for :func:`qbits.quantize`.
      config: The rules, as for :func:`qbits.quantize`.
      *args: Its arguments.
      params_argnum: As for :func:`qbits.quantize`.
      **kwargs: Its keyword arguments.

    Example:
      >>> def f(params, x):
      ...     return x @ params["w"]
      >>> probes = qbits.diagnostics.init(f, "int8", {"w": jnp.ones((4, 2))},
      ...                                 jnp.ones((3, 4)))
      >>> list(probes)
      ['w']
    """
    return transform._init_probes(
        _INIT, fn, config, *args, params_argnum=params_argnum, **kwargs
    )


def diagnose(
    fn: Callable[..., Any],
    config: Any,
    key: jax.Array | None = None,
    *,
    state: Mapping[str, Any] | None = None,
    params_argnum: int | None = 0,
) -> Callable[..., tuple[Any, Metrics]]:
    """``fn`` quantized by ``config``, returning its output and :class:`Metrics`.

    For a scalar (float) output, a loss, the metrics cover the forward and
    both backward matmuls: the output is differentiated with respect to
    the parameters (``args[params_argnum]``), as a training step would.
    For any other output (a model's logits, evaluation only) they cover the
    forward operands; the backward ones are NaN. The work runs jitted (one
    compilation per argument shapes); the metrics come back as NumPy.

    The metrics are read in reverse mode, which JAX cannot run through a
    ``lax.while_loop`` (nor a ``fori_loop`` with traced bounds): a matmul
    whose probe flows into one (a matmul in its body, or before it) is not
    measured (NaN), and the parameters that flow into one are not
    differentiated (the backward operands that need their gradient are
    NaN). Everything else is measured, and a ``UserWarning`` names what is
    not (once per compilation). ``lax.scan`` and ``fori_loop`` with static
    bounds are measured in full.

    Inside a training step of your own, use the pieces instead: :func:`init`
    the probes, pass them to ``qbits.quantize(..., diagnostics=probes)``,
    differentiate with respect to them, and :func:`read` the gradient.

    Args:
      fn: The function, as for :func:`qbits.quantize`.
      config: The rules, as for :func:`qbits.quantize`.
      key: PRNG key for stochastic rounding, as for :func:`qbits.quantize`.
      state: Scale state, as for :func:`qbits.quantize` (its new state is
        not returned: diagnostics observe, they do not train).
      params_argnum: As for :func:`qbits.quantize`.

    Returns:
      A function of ``fn``'s arguments returning ``(output, metrics)``.

    Example:
      >>> def loss(params, x):
      ...     return jnp.mean((x @ params["w"]) ** 2)
      >>> params = {"w": jax.random.normal(jax.random.key(0), (16, 4))}
      >>> x = jax.random.normal(jax.random.key(1), (8, 16))
      >>> value, metrics = qbits.diagnostics.diagnose(loss, "fp8")(params, x)
      >>> metrics.operands  # x is not differentiated: no input gradient
      ('fwd.lhs', 'fwd.rhs', 'drhs.grad', 'drhs.lhs')
      >>> bool(metrics.values["w"]["drhs.grad"]["sqnr_db"] < 30)  # E5M2
      True
    """
    if not callable(fn):
        raise InvalidArgumentError(_DIAGNOSE.owner, "fn", fn, "a function")

    traced: list[str] = []  # what a new trace of ``run`` found to say

    @jax.jit
    def run(args: tuple[Any, ...], kwargs: dict[str, Any], probes: Any) -> Any:
        n = params_argnum

        def f(params: Any, probes: Any) -> Any:
            a = list(args)
            if n is not None:
                a[n] = params
            q = transform._quantize(
                _DIAGNOSE, fn, config, key, state=state, diagnostics=probes,
                params_argnum=n,
            )  # fmt: skip
            return q(*a, **kwargs)

        params = None if n is None else args[n]
        closed, shape = jax.make_jaxpr(f, return_shape=True)(params, probes)
        scalar = _is_loss(shape)
        leaves, tree = jax.tree.flatten((params, probes))
        n_params = len(jax.tree.leaves(params))
        stuck = into_while(closed.jaxpr)
        traced.append(_stuck_message(tree, stuck, n_params if scalar else 0))
        # Not differentiated: what flows into a while_loop (reverse mode
        # cannot pass one), and the parameters unless fn is a loss.
        fixed = [s or (i < n_params and not scalar) for i, s in enumerate(stuck)]

        def moved(free: list[Any]) -> Any:
            it = iter(free)
            return f(*tree.unflatten([x if s else next(it) for x, s in
                                      zip(leaves, fixed, strict=True)]))  # fmt: skip

        free = [x for x, s in zip(leaves, fixed, strict=True) if not s]
        out, vjp = jax.vjp(moved, free)
        ct = jnp.ones_like(out) if scalar else jax.tree.map(jnp.zeros_like, out)
        it = iter(vjp(ct)[0])
        grads = [
            jnp.zeros_like(x) if s else next(it)
            for x, s in zip(leaves, fixed, strict=True)
        ]
        return out, tree.unflatten(grads)[1]

    def diagnosed(*args: Any, **kwargs: Any) -> tuple[Any, Metrics]:
        probes = init(fn, config, *args, params_argnum=params_argnum, **kwargs)
        traced.clear()
        out, raw = run(args, kwargs, probes)
        for message in filter(None, traced):  # once per compilation
            warnings.warn(message, UserWarning, stacklevel=2)
        metrics = read(raw)
        if _is_loss(out):
            return out, metrics
        # No backward pass (its matmuls saw a zero cotangent): NaN.
        return out, Metrics({
            path: {op: m if op.startswith("fwd.") else
                   {k: np.full_like(v, np.nan) for k, v in m.items()}
                   for op, m in by_op.items()}
            for path, by_op in metrics.values.items()
        })  # fmt: skip

    return diagnosed
