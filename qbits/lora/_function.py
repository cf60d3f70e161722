"""The adapted model and its frozen base: what :func:`~qbits.lora.apply` returns.

:class:`LoraFunction` runs the model through the engine
(:func:`qbits.transform.adapt`): the base's matmuls on their stored
(quantized) weights where it has them, every adapter's ``(alpha / rank)
(dropout(x) A) B`` added to its matmul's output. :class:`LoraBase` is the
frozen base (a pytree), :class:`AdaptedLayer` one matmul's row of the
table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from qbits import transform
from qbits._errors import InvalidArgumentError
from qbits._sharding import like
from qbits._tensor import QTensor
from qbits.config import QuantConfig
from qbits.lora._config import LoraConfig

__all__ = ["AdaptedLayer", "Lora", "LoraBase", "LoraFunction"]

_CALLER = transform._Caller("qbits.lora", key="dropout_key")


class LoraBase(struct.PyTreeNode):
    """The frozen base of an adapted model: its parameters, weights stored.

    A pytree (pass it through ``jax.jit``; never to the optimizer).

    Attributes:
      params: The model's parameters as given to :func:`apply`, each one
        that a stored weight replaces an empty placeholder (shape ``(0,)``,
        its dtype). With a float base: the parameters as they are.
      weights: ``{matmul path: QTensor}``: the base's stored weights, in
        their storage format (int4, uint4 and NF4 codes packed two per
        byte in uint8; int8; fp8), with their scales.
      fills: Static: ``(key path, shape, dtype, matmul path)`` of each
        placeholder.

    Example:
      >>> params = {"w": jnp.ones((64, 8))}
      >>> out = qbits.lora.apply(lambda p, x: x @ p["w"],
      ...     qbits.lora.LoraConfig(rank=2, base="nf4"), params, jnp.ones((1, 64)),
      ...     key=jax.random.key(0))
      >>> out.base.params["w"].shape, out.base.weights["w"].qvalue.dtype
      ((0,), dtype('uint8'))
      >>> nbytes = lambda t: sum(x.nbytes for x in jax.tree.leaves(t))
      >>> nbytes(out.base), nbytes(params)  # codes + scales
      (288, 2048)
    """

    params: Any
    weights: dict[str, QTensor]
    fills: tuple[tuple[str, tuple[int, ...], str, str], ...] = struct.field(
        pytree_node=False, default=()
    )

    def filled(self) -> Any:
        """The parameters with zeros in the placeholders (what the model reads).

        Under ``jax.jit`` the zeros are never materialised: the matmuls
        that would read them run on the stored weights. They are laid out
        as the stored codes (under explicit mesh axes what follows the
        matmul keeps the float model's layout).
        """
        shapes = {path: found for path, *found in self.fills}

        def leaf(path: Any, x: Any) -> Any:
            found = shapes.get(jax.tree_util.keystr(path))
            if found is None:
                return x
            zeros = jnp.zeros(found[0], found[1])
            codes = self.weights[found[2]].qvalue
            if jnp.ndim(codes) != zeros.ndim:
                return zeros
            return like(zeros, codes, range(zeros.ndim))

        return jax.tree_util.tree_map_with_path(leaf, self.params)


@dataclasses.dataclass(frozen=True)
class AdaptedLayer:
    """One matmul of the adapted model and what it gets.

    Attributes:
      path: The matmul's path, as :func:`qbits.layer_table` names it.
      kind: Its kind, as in the layer table.
      operands: Its operand types.
      rank: Its adapter's rank, or ``None`` (no adapter).
      alpha: Its adapter's alpha, or ``None``.
      rule: The index of the rule that decided it, or ``None``.
      why_not: Why it has no adapter, or ``""``.
      base: How its weight is held: the base config's name (``"nf4"``,
        ``"inline"``) for a stored weight, ``"float"`` otherwise.
      merge: Why :func:`~qbits.lora.merge` cannot fold its adapter into
        the parameter, or ``""``.
      matmul: How the engine sees it (:class:`~qbits.transform.ObservedMatmul`),
        or ``None`` for a matmul that cannot be adapted.
      index: Where its weight operand sits in its parameter
        (a kernel stored ``(out, in)``
        and transposed before the matmul), or ``None``: the parameter as
        it is (or a matmul with neither adapter nor stored weight).

    Example:
      >>> from qbits import lora
      >>> def head(params, x):
      ...     return x @ params["w"]
      >>> params, x = {"w": jnp.ones((8, 4))}, jnp.ones((2, 8))
      >>> fn, base, adapters = lora.apply(head, lora.LoraConfig(rank=2), params, x,
      ...                                 key=jax.random.key(0))
      >>> [(layer.path, layer.rank) for layer in fn.layers]
      [('w', 2)]
    """

    path: str
    kind: str
    operands: str
    rank: int | None
    alpha: float | None
    rule: int | None
    why_not: str
    base: str
    merge: str = ""
    matmul: Any = dataclasses.field(default=None, repr=False)
    index: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def scale(self) -> float:
        """``alpha / rank`` (0 without an adapter)."""
        return 0.0 if self.rank is None else float(self.alpha) / self.rank  # type: ignore[arg-type]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The shapes of its adapter's ``a`` and ``b`` (empty without one)."""
        if self.rank is None:
            return {}
        m = self.matmul
        lead = (*m.layers, *m.groups)
        return {"a": (*lead, m.k, self.rank), "b": (*lead, self.rank, m.n)}


class LoraFunction:
    """The adapted model: ``fn(adapters, base, *args, dropout_key=None, **kwargs)``.

    Runs the model on the frozen base (stored weights where the base
    quantizes them) with every adapter added to its matmul's output; the
    output is the model's (an nnx model's: ``(output, new state)``, as
    :func:`qbits.nnx.as_function` gives it). Differentiate with respect to
    ``adapters`` only: the base takes no gradient. With a ``dropout_key``
    (training) the adapters' inputs are dropped with ``config.dropout``;
    without one (evaluation) they are not.

    Attributes:
      config: The :class:`~qbits.lora.LoraConfig`.
      layers: One :class:`AdaptedLayer` per matmul of the model, in program
        order (also those without an adapter).
      base_rules: The rules the base's matmuls run with (the stored ones
        only).

    Example:
      >>> def mlp(params, x):
      ...     return jax.nn.relu(x @ params["w1"]) @ params["w2"]
      >>> params = {"w1": jnp.ones((64, 32)), "w2": jnp.ones((32, 4))}
      >>> fn, base, adapters = qbits.lora.apply(
      ...     mlp, qbits.lora.LoraConfig(rank=4), params, jnp.ones((2, 64)),
      ...     key=jax.random.key(0))
      >>> print(fn.table().splitlines()[0])  # print(fn): one row per matmul
      | layer | kind | operands | adapter | base | from |
      >>> [(la.path, la.rank, la.scale, la.base) for la in fn.layers]
      [('w1', 4, 4.0, 'float'), ('w2', 4, 4.0, 'float')]
      >>> grads = jax.grad(lambda a: fn(a, base, jnp.ones((2, 64))).sum())(adapters)
      >>> sorted(grads["w2"]), grads["w2"]["a"].shape
      (['a', 'b'], (32, 4))
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        config: LoraConfig,
        layers: tuple[AdaptedLayer, ...],
        base_rules: QuantConfig,
    ):
        self.fn = fn
        self.config = config
        self.layers = layers
        self.base_rules = base_rules
        self._adapted = {la.path: la for la in layers if la.rank is not None}

    def __call__(
        self,
        adapters: Mapping[str, Any],
        base: LoraBase,
        *args: Any,
        dropout_key: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Runs the model on ``base`` with ``adapters`` (see the class)."""
        self._check(adapters, base)
        rate = float(self.config.dropout)
        scales = {path: la.scale for path, la in self._adapted.items()}
        adapter = transform.Adapter(
            _low_rank(scales, rate), needs_key=rate > 0 and dropout_key is not None
        )
        run = transform._adapt(
            _CALLER, self.fn, self.base_rules, adapter, dict(adapters),
            dropout_key, stored=base.weights,
        )  # fmt: skip
        return run(base.filled(), *args, **kwargs)

    def _check(self, adapters: Any, base: Any) -> None:
        if not isinstance(base, LoraBase):
            raise InvalidArgumentError(
                "qbits.lora", "base", type(base).__name__,
                "the qbits.lora.LoraBase that qbits.lora.apply returned",
            )  # fmt: skip
        if not isinstance(adapters, Mapping) or set(adapters) != set(self._adapted):
            raise InvalidArgumentError(
                "qbits.lora", "adapters",
                sorted(adapters) if isinstance(adapters, Mapping) else adapters,
                "the adapters of exactly the matmuls "
                + ", ".join(sorted(self._adapted)) + " (qbits.lora.apply made them)",
            )  # fmt: skip
        for path, la in self._adapted.items():
            ab = adapters[path]
            got = (
                {k: tuple(jnp.shape(v)) for k, v in ab.items()}
                if isinstance(ab, Mapping)
                else ab
            )
            if got != la.shapes():
                raise InvalidArgumentError(
                    "qbits.lora", f"adapters[{path!r}]", got,
                    f"{la.shapes()} (rank {la.rank} for this matmul)",
                    why="adapters of another config or model?",
                )  # fmt: skip

    def table(self) -> str:
        """The per-matmul table (markdown), as ``str(fn)``."""
        lines = [
            "| layer | kind | operands | adapter | base | from |",
            "|---|---|---|---|---|---|",
        ]
        for la in self.layers:
            adapter = (
                f"rank {la.rank}, alpha {la.alpha:g}"
                if la.rank is not None
                else f"none: {la.why_not}"
            )
            where = "" if la.rule is None else f"rules[{la.rule}]"
            lines.append(
                f"| {la.path} | {la.kind} | {la.operands} | {adapter} | "
                f"{la.base} | {where} |"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


class Lora(NamedTuple):
    """What :func:`apply` returns: ``fn, base, adapters = apply(...)``.

    Attributes:
      fn: The adapted model, a :class:`LoraFunction`:
        ``fn(adapters, base, *args, dropout_key=None, **kwargs)``.
      base: The frozen base, a :class:`LoraBase`.
      adapters: The trainable parameters: ``{matmul path: {"a": A, "b": B}}``
        (float32; ``A`` of shape ``(*layers, *groups, K, rank)``, ``B``
        zeros of shape ``(*layers, *groups, rank, N)``).

    Example:
      >>> from qbits import lora
      >>> def head(params, x):
      ...     return x @ params["w"]
      >>> params, x = {"w": jnp.ones((8, 4))}, jnp.ones((2, 8))
      >>> out = lora.apply(head, lora.LoraConfig(rank=2), params, x,
      ...                  key=jax.random.key(0))
      >>> isinstance(out, lora.Lora), out.adapters["w"]["a"].shape
      (True, (8, 2))
    """

    fn: LoraFunction
    base: LoraBase
    adapters: dict[str, dict[str, jax.Array]]


def _low_rank(scales: dict[str, float], rate: float) -> Callable[..., jax.Array]:
    def apply_adapter(matmul: Any, rows: jax.Array, ab: Any, key: Any) -> jax.Array:
        a, b = ab["a"], ab["b"]
        x = rows.astype(a.dtype)
        if key is not None:
            keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
            x = jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), 0)
        return ((x @ a) @ b) * jnp.asarray(scales[matmul.path], a.dtype)

    return apply_adapter
