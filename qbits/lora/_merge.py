"""``merge``: adapters folded back into the model's float parameters.

Each adapted weight becomes ``W + (alpha / rank) * A B``, reshaped from the
``(K, N)`` matrix the adapter works on back to the weight operand's own
axes (one matrix per group and per stacked layer), and written back into
the parameter where the matmul reads it (transposed back, for a kernel the
model transposes before multiplying); each stored base weight becomes its
dequantized value first. The result is the model's parameters, the
same tree, shapes and dtypes as given to :func:`~qbits.lora.apply`: serve
them float, or quantize them again (:func:`qbits.serving.convert` with
the base's config; the merged weights then round to the grid once more).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qbits._errors import InvalidArgumentError
from qbits.lora._function import AdaptedLayer, LoraBase, LoraFunction

__all__ = ["merge"]

_OWNER = "qbits.lora.merge"


def _delta(layer: AdaptedLayer, adapter: Mapping[str, Any]) -> jax.Array:
    """One adapter's update ``(alpha/rank) A B`` of its matmul's weight operand.

    In the operand's own layout, stacked along the scans over stacked
    layers: shape ``(*layers, *operand shape)``.
    """
    m = layer.matmul
    ab = adapter["a"] @ adapter["b"] * jnp.asarray(layer.scale, adapter["a"].dtype)
    lead = m.layers
    order = (*m.batch, *m.contracting, *m.free)
    if not m.grouped and m.batch:  # one matrix, broadcast along the batch axes
        ab = jnp.broadcast_to(
            ab[..., None, :, :],
            (*lead, *(m.shape[a] for a in m.batch), m.k, m.n),
        )
    moved = ab.reshape(*lead, *(m.shape[a] for a in order))
    n = len(lead)
    return jnp.transpose(moved, (*range(n), *(n + a for a in np.argsort(order))))


def merge(fn: LoraFunction, adapters: Mapping[str, Any], base: LoraBase) -> Any:
    """The model's float parameters with the adapters folded in.

    Stored base weights are dequantized, then every adapted weight gets
    its update ``(alpha / rank) A B`` added, in float32, and is cast back to the
    parameter's dtype. ``fn.fn(merged, x)`` (the model itself, in float)
    then equals ``fn(adapters, base, x)`` within float rounding; quantize
    ``merged`` again for a quantized server (the weights then move to
    their grids once more: within one quantization step of the adapted
    weights).

    Args:
      fn: The adapted model, from :func:`~qbits.lora.apply`.
      adapters: Its adapters (trained).
      base: Its frozen base.

    Returns:
      The parameters, the same tree, shapes and dtypes as those given to
      :func:`~qbits.lora.apply` (an nnx model's state: ``nnx.update``
      the model with it).

    A weight the model rearranges before its matmul (a kernel stored
    ``(out, in)`` and transposed, as Hugging Face's GPT-2 stores them; a
    reshape) is updated in the matmul's layout and written back where the
    matmul reads it (its row in
    :attr:`LoraFunction.layers <qbits.lora.LoraFunction.layers>`: ``index``).

    Raises:
      InvalidArgumentError: For adapters or a base of another model (naming
        the parameters that differ), or a weight that cannot be folded
        back (the layer's ``merge`` in :attr:`~qbits.lora.LoraFunction.layers` says why:
        a parameter read by another matmul or a lookup too, or broadcast
        before its matmul).

    Example:
      >>> def mlp(params, x):
      ...     return jax.nn.relu(x @ params["w1"]) @ params["w2"]
      >>> k1, k2 = jax.random.split(jax.random.key(0))
      >>> params = {"w1": jax.random.normal(k1, (64, 32)),
      ...           "w2": jax.random.normal(k2, (32, 4))}
      >>> x = jnp.ones((2, 64))
      >>> fn, base, ad = qbits.lora.apply(mlp, qbits.lora.LoraConfig(rank=4),
      ...                                 params, x, key=jax.random.key(1))
      >>> ad = jax.tree.map(lambda v: v + 0.1, ad)  # as if trained
      >>> merged = qbits.lora.merge(fn, ad, base)
      >>> bool(jnp.allclose(mlp(merged, x), fn(ad, base, x), rtol=1e-5, atol=1e-4))
      True
    """
    if not isinstance(fn, LoraFunction):
        raise InvalidArgumentError(
            _OWNER, "fn", type(fn).__name__, "the LoraFunction qbits.lora.apply gave"
        )
    fn._check(adapters, base)
    layers = []
    for layer in fn.layers:
        if layer.path not in base.weights and layer.rank is None:
            continue
        if layer.merge:
            what = "adapter" if layer.rank is not None else "stored weight"
            raise InvalidArgumentError(
                _OWNER, "adapters" if layer.rank is not None else "base",
                f"the {what} of {layer.path!r}",
                "weights that fold back into their parameters (exclude the "
                "layer from the rules with LoraRule(pattern, adapt=False), or "
                "keep the adapters unmerged)",
                why=layer.merge,
            )  # fmt: skip
        layers.append(layer)
    _check_base(fn, base)
    # The index maps as arguments (int32), not as constants of the program.
    index = {
        la.path: jnp.asarray(la.index, jnp.int32)
        for la in layers
        if la.index is not None
    }
    return jax.jit(functools.partial(_merged, tuple(layers)))(adapters, base, index)


def _check_base(fn: LoraFunction, base: LoraBase) -> None:
    """Raises unless ``base`` holds what ``fn`` reads: the parameters, the weights."""
    leaves = {
        jax.tree_util.keystr(k): tuple(jnp.shape(v))
        for k, v in jax.tree_util.tree_flatten_with_path(base.params)[0]
    }
    fills = {path: tuple(shape) for path, shape, *_ in base.fills}
    problems = []
    for la in fn.layers:
        m = la.matmul
        if m is None or (la.rank is None and la.base == "float"):
            continue
        name = jax.tree_util.keystr(m.keys)
        got = fills.get(name, leaves.get(name))
        if got is None:
            problems.append(f"no parameter {name}")
        elif got != tuple(m.param_shape):
            reads = list(m.param_shape)
            problems.append(f"{name} of shape {list(got)} ({la.path!r} reads {reads})")
        want = (*m.layers, *m.shape)
        if la.base != "float":
            qt = base.weights.get(la.path)
            if qt is None:
                problems.append(f"no stored weight {la.path!r}")
            elif tuple(qt.shape) != want:
                problems.append(
                    f"stored weight {la.path!r} of shape {list(qt.shape)} "
                    f"(fn's: {list(want)})"
                )
    if problems:
        more = [f"{len(problems) - 3} more"] if len(problems) > 3 else []
        raise InvalidArgumentError(
            _OWNER, "base", f"a base unlike fn's in {len(problems)} place(s)",
            "the LoraBase that qbits.lora.apply returned together with fn "
            "(fn, base, adapters = qbits.lora.apply(model, config, params, "
            "...)): the base of the same model and parameters",
            why="; ".join(problems[:3] + more),
        )  # fmt: skip


def _merged(
    layers: tuple[AdaptedLayer, ...], adapters: Any, base: LoraBase, index: Any
) -> Any:
    params = dict(jax.tree_util.tree_flatten_with_path(base.params)[0])
    shapes = {path: (shape, dtype) for path, shape, dtype, _ in base.fills}

    def param(keys: tuple[Any, ...]) -> jax.Array:
        """The parameter in float32 (zeros where a stored weight replaced it)."""
        name = jax.tree_util.keystr(keys)
        if name in shapes:
            return jnp.zeros(shapes[name][0], jnp.float32)
        return jnp.asarray(params[keys], jnp.float32)

    by_keys: dict[Any, jax.Array] = {}
    for layer in layers:
        keys, idx = layer.matmul.keys, index.get(layer.path)
        stored = base.weights.get(layer.path)
        if stored is not None:
            operand = stored.dequant().astype(jnp.float32)
        else:
            full = param(keys)
            operand = full if idx is None else full.reshape(-1)[idx]
        if layer.rank is not None:
            operand = operand + _delta(layer, adapters[layer.path]).astype(jnp.float32)
        if idx is None:  # the operand is the parameter
            by_keys[keys] = operand.reshape(param(keys).shape)
        else:  # written back where the matmul reads it
            full = param(keys)
            flat = full.reshape(-1).at[idx.reshape(-1)].set(operand.reshape(-1))
            by_keys[keys] = flat.reshape(full.shape)

    def leaf(path: Any, x: Any) -> Any:
        key = tuple(path)
        if key in by_keys:
            name = jax.tree_util.keystr(path)
            dtype = shapes[name][1] if name in shapes else x.dtype
            return by_keys[key].astype(dtype)
        return x

    return jax.tree_util.tree_map_with_path(leaf, base.params)
