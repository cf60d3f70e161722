"""``serving_params``: a checkpoint's tensors onto a JAX model's parameters.

A name table maps each PyTorch tensor name (``model.layers.0.mlp.up_proj
.weight``) onto a JAX parameter path, its keys joined by ``/``
(``model/layers/0/mlp/up_proj/kernel``; an nnx ``Variable``'s ``value``
left out): ``(regex, template)`` pairs, the first whose regex matches the
whole name wins, ``re`` backreferences filling the template. A 2-D
PyTorch ``weight`` that lands on a ``kernel`` is transposed (``Linear``
is ``[out, in]``, a kernel ``[in, out]``), then every tensor is reshaped
to its parameter's shape (``[in, heads, head_dim]`` for a
``LinearGeneral``): quantized weights too, codes and scales alike, never
dequantized, laid out as the matmul reads the parameter (Flax GPT-2's
``Conv1D`` kernel is ``[out, in]``, multiplied transposed: its stored
weight is ``[in, out]``, the parameter a shape only).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qbits import serving, transform
from qbits._errors import InvalidArgumentError
from qbits._granularity import Tiled
from qbits._quantizer import Quantizer
from qbits._tensor import QTensor
from qbits.config import QuantConfig, Rule
from qbits.interop._checkpoint import Checkpoint
from qbits.ops import DotGeneralConfig, MatmulConfig
from qbits.ptq import PtqResult

__all__ = ["NAMES", "serving_params"]

OWNER = "qbits.interop.serving_params"

#: Built-in name tables: Hugging Face Llama and GPT-2 (the parameter paths
#: of transformers' FlaxLlamaForCausalLM and FlaxGPT2LMHeadModel; GPT-2's
#: head is tied to ``wte``) and qbits' example LM (``qbits train``), its
#: PyTorch twin named as it is.
NAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "gpt2": (
        (r"transformer\.(wte|wpe)\.weight", r"transformer/\1/embedding"),
        (
            r"transformer\.h\.(\d+)\.(attn|mlp)\.(\w+)\.weight",
            r"transformer/h/\1/\2/\3/kernel",
        ),
        (
            r"transformer\.h\.(\d+)\.(attn|mlp)\.(\w+)\.bias",
            r"transformer/h/\1/\2/\3/bias",
        ),
        (r"transformer\.h\.(\d+)\.(ln_\d)\.weight", r"transformer/h/\1/\2/scale"),
        (r"transformer\.h\.(\d+)\.(ln_\d)\.bias", r"transformer/h/\1/\2/bias"),
        (r"transformer\.ln_f\.weight", "transformer/ln_f/scale"),
        (r"transformer\.ln_f\.bias", "transformer/ln_f/bias"),
        # The head is tied to wte: a checkpoint that holds it too (AutoGPTQ
        # saves the whole state dict) holds it equal, which is checked.
        (r"lm_head\.weight", "transformer/wte/embedding"),
    ),
    "llama": (
        (r"model\.embed_tokens\.weight", "model/embed_tokens/embedding"),
        (
            r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.weight",
            r"model/layers/\1/\2/\3/kernel",
        ),
        (
            r"model\.layers\.(\d+)\.(\w+_layernorm)\.weight",
            r"model/layers/\1/\2/weight",
        ),
        (r"model\.norm\.weight", "model/norm/weight"),
        (r"lm_head\.weight", "lm_head/kernel"),
    ),
    "qbits-lm": (
        (r"embed\.weight", "embed/embedding"),
        (r"pos", "pos"),
        (r"blocks\.(\d+)\.(attn|mlp)\.(\w+)\.weight", r"blocks/\1/\2/\3/kernel"),
        (r"blocks\.(\d+)\.(attn|mlp)\.(\w+)\.bias", r"blocks/\1/\2/\3/bias"),
        (r"blocks\.(\d+)\.(norm\d)\.weight", r"blocks/\1/\2/scale"),
        (r"blocks\.(\d+)\.(norm\d)\.bias", r"blocks/\1/\2/bias"),
        (r"norm\.weight", "norm/scale"),
        (r"(norm|head)\.bias", r"\1/bias"),
        (r"head\.weight", "head/kernel"),
    ),
}


def _table(names: Any) -> tuple[tuple[str, str], ...]:
    if isinstance(names, str) and names in NAMES:
        return NAMES[names]
    try:
        pairs = tuple((str(a), str(b)) for a, b in names)
        for a, _ in pairs:
            re.compile(a)
    except (TypeError, ValueError, re.error) as e:
        raise InvalidArgumentError(
            OWNER,
            "names",
            names,
            f"one of {sorted(NAMES)} or (regex, template) pairs",
            why=e,
        ) from None
    return pairs


def _path(keys: Sequence[Any]) -> str:
    parts = []
    for k in keys:
        part = getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))
        parts.append(str(part))
    if (
        parts
        and parts[-1] == "value"
        and isinstance(keys[-1], jax.tree_util.GetAttrKey)
    ):
        parts.pop()  # an nnx Variable's value
    return "/".join(parts)


def _reshaped(qt: QTensor, shape: tuple[int, ...], where: str) -> QTensor:
    """A stored ``[in, out]`` weight laid out as a parameter of ``shape``."""
    n_in, n_out = qt.shape
    if tuple(shape) == (n_in, n_out):  # a kernel as stored (block scales too)
        return qt
    if shape[0] == n_in and math.prod(shape[1:]) == n_out:  # [in, *out]
        lead, rest = 1, shape[1:]
    elif shape[-1] == n_out and math.prod(shape[:-1]) == n_in:  # [*in, out]
        lead, rest = len(shape) - 1, shape[-1:]
    else:
        raise InvalidArgumentError(
            OWNER,
            where,
            f"a [{n_out}, {n_in}] weight",
            f"a weight of {math.prod(shape)} entries for a "
            f"parameter of shape {list(shape)}",
        )

    def split(a: jax.Array) -> jax.Array:  # (G or 1, out or 1): the same blocks
        if a.shape == (1, 1):
            return a.reshape((1,) * len(shape))
        g = a.shape[0]
        head = shape[:lead]
        front = (*head[:-1], head[-1] * g // n_in) if g > 1 else (1,) * lead
        return a.reshape(*front, *rest)

    codes = qt.qvalue
    packed = list(shape)
    if qt.packed_axis is not None:
        packed[-1] = -(-packed[-1] // 2)
    return qt.replace(
        qvalue=codes.reshape(packed),
        scale=split(qt.scale),
        zero_point=None if qt.zero_point is None else split(qt.zero_point),
    )


def serving_params(
    checkpoint: Checkpoint,
    fn: Callable[..., Any],
    params: Any,
    *args: Any,
    names: Any = "llama",
    **kwargs: Any,
) -> tuple[serving.ServingParams, QuantConfig]:
    r"""A checkpoint's weights as serving params of a JAX function.

    Args:
      checkpoint: From :func:`read_checkpoint`.
      fn: The model as a function ``fn(params, *args, **kwargs)`` (a linen
        ``model.apply``; an nnx model's ``qbits.nnx.as_function``).
      params: Its parameter tree; leaves may be ``jax.ShapeDtypeStruct`` s
        (``jax.eval_shape`` of the init): only shapes and dtypes are read,
        every value comes from the checkpoint.
      *args: Sample inputs (arrays or ``jax.ShapeDtypeStruct`` s).
      names: A name table: ``"llama"`` and ``"gpt2"`` (Hugging Face
        Llama and GPT-2, onto their Flax models' parameter paths),
        ``"qbits-lm"`` (qbits' example LM), or ``(regex, template)`` pairs
        from PyTorch tensor names to ``/``-joined parameter paths.
      **kwargs: Keyword arguments of ``fn``.

    Returns:
      ``(serving_params, config)``: run with
      ``qbits.serving.serve(fn, config)(serving_params, *args)``; each
      quantized matmul computes on the checkpoint's codes and scales (no
      float copy of the weight), its input quantized where the checkpoint
      says so (:attr:`Checkpoint.activations`), everything else in float. (Finding the
      matmuls traces ``fn`` through the engine's storing pass, which
      computes on zeros of each weight's shape for a moment; nothing of it
      is kept.)

    Raises:
      InvalidArgumentError: For a tensor no rule maps (or mapped onto no
        parameter), a parameter no tensor maps onto, or a shape that does
        not fit.

    Example:
      >>> import os, qbits.interop
      >>> ckpt = qbits.interop.read_checkpoint(os.path.join(
      ...     "tests", "data", "quantized", "ct_w8_channel"))
      >>> def fn(p, x):
      ...     x = x @ p["q"]["kernel"]
      ...     return x @ p["o"]["kernel"]
      >>> names = [(r".*\.(q|o)_proj\.weight", r"\1/kernel")]
      >>> params = {k: {"kernel": jax.ShapeDtypeStruct(s, jnp.float32)}
      ...           for k, s in (("q", (64, 32)), ("o", (32, 32)))}
      >>> ckpt = qbits.interop.Checkpoint(ckpt.format, ckpt.weights,
      ...     ckpt.quantizers, {}, ckpt.quantization_config)  # the head unused
      >>> sp, config = qbits.interop.serving_params(
      ...     ckpt, fn, params, jnp.ones((2, 64)), names=names)
      >>> sorted(sp.weights), sp.weights["q"]["qvalue"].dtype
      (['o', 'q'], dtype('int8'))
      >>> qbits.serving.serve(fn, config)(sp, jnp.ones((2, 64))).shape
      (2, 32)
    """
    table = _table(names)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    paths = {_path(kp): i for i, (kp, _) in enumerate(leaves)}
    found: dict[int, Any] = {}
    sources = [(f"{m}.weight", qt) for m, qt in checkpoint.weights.items()]
    sources += list(checkpoint.tensors.items())
    for name, value in sources:
        target = next(
            (
                re.sub(f"(?:{rx})", tpl, name)
                for rx, tpl in table
                if re.fullmatch(rx, name)
            ),
            None,
        )
        if target is None or target not in paths:
            raise InvalidArgumentError(
                OWNER,
                f"checkpoint tensor {name!r}",
                "mapped by no rule" if target is None else f"mapped onto {target!r}",
                "a parameter path of the model (names=)",
            )
        i = paths[target]
        leaf = leaves[i][1]
        shape = tuple(leaf.shape)
        if isinstance(value, QTensor):  # laid out as its matmul reads it, below
            if math.prod(value.shape) != math.prod(shape):
                raise InvalidArgumentError(
                    OWNER, f"checkpoint tensor {name!r}",
                    f"a [{value.shape[1]}, {value.shape[0]}] weight",
                    f"a weight of {math.prod(shape)} entries for a parameter "
                    f"of shape {list(shape)}",
                )  # fmt: skip
        else:
            a = np.asarray(value)
            if a.ndim == 2 and target.endswith("kernel"):
                a = a.T
            if a.size != math.prod(shape):
                raise InvalidArgumentError(
                    OWNER,
                    f"checkpoint tensor {name!r}",
                    f"shape {list(a.shape)}",
                    f"{list(shape)}, as parameter {target!r}",
                )
            value = jnp.asarray(a.reshape(shape), leaf.dtype)
        if i in found:  # a tied parameter: its tensors, in float, must agree
            first, other = found[i]
            quantized = isinstance(value, QTensor) or isinstance(other, QTensor)
            if quantized or not np.array_equal(other, value):
                raise InvalidArgumentError(
                    OWNER, f"checkpoint tensor {name!r}",
                    f"mapped onto {target!r}, as {first!r} is, and different",
                    "one tensor a parameter (a tied head equal to its "
                    "embedding; quantized weights are never tied), or names= "
                    "that map them apart",
                )  # fmt: skip
            continue
        found[i] = (name, value)
    missing = [p for p, i in paths.items() if i not in found]
    if missing:
        raise InvalidArgumentError(
            OWNER,
            "params",
            f"parameter {missing[0]!r}",
            "parameters the checkpoint's tensors map onto",
            why=f"no tensor maps onto {len(missing)} of them",
        )
    filled = [
        jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
        if isinstance(found[i][1], QTensor)
        else found[i][1]
        for i, (_, leaf) in enumerate(leaves)
    ]
    tree = jax.tree.unflatten(treedef, filled)
    stored = {i: qt for i, (_, qt) in found.items() if isinstance(qt, QTensor)}
    quantizers = {
        i: checkpoint.quantizers[found[i][0][: -len(".weight")]] for i in stored
    }
    # Which matmul reads each quantized parameter (any weight quantizer will do).
    probe = DotGeneralConfig(fwd=MatmulConfig(rhs=next(iter(quantizers.values()))))
    caller = transform._Caller(OWNER)
    matmuls = transform._store_weights(caller, fn, probe, tree, *args, **kwargs)
    by_keys = {tuple(leaves[i][0]): i for i in stored}
    given: dict[str, QTensor] = {}
    paths_of: dict[str, int] = {}
    rules = []
    for path, s in matmuls.items():
        i = by_keys.get(tuple(s.keys))
        if i is None:
            continue
        # The weight as the matmul reads it: the parameter, or the parameter
        # rearranged (Flax GPT-2's Conv1D kernel [out, in], read transposed).
        where = f"checkpoint tensor {found[i][0]!r}"
        operand = tuple(s.weight.shape)
        if s.contracting != tuple(range(len(s.contracting))):
            raise InvalidArgumentError(
                OWNER, where, f"read by {path!r} as a {list(operand)} operand "
                f"contracting axes {list(s.contracting)}",
                "a parameter its matmul reads with the input axes first "
                "([*in, *out], transposed or not)",
            )  # fmt: skip
        given[path] = _reshaped(stored[i], operand, where)
        paths_of[path] = i
        q: Quantizer = quantizers[i]
        inputs = checkpoint.activations.get(found[i][0][: -len(".weight")])
        if isinstance(getattr(inputs, "granularity", None), Tiled) and (
            len(s.contracting) > 1
        ):  # groups of the flattened input: not Tiled's over one of its axes
            raise InvalidArgumentError(
                OWNER, where, f"read by {path!r} contracting "
                f"{len(s.contracting)} axes, its inputs quantized in groups "
                f"of {inputs.granularity.tile_size}",
                "a model whose matmul reads that layer's input flattened "
                "([..., in], as a Dense layer does), so that the groups are "
                "the checkpoint's",
            )  # fmt: skip
        # the inputs too, where the checkpoint quantizes them
        mm = MatmulConfig(rhs=q) if inputs is None else MatmulConfig(lhs=inputs, rhs=q)
        rules.append(Rule(re.escape(path), DotGeneralConfig(fwd=mm)))
    config = QuantConfig(rules=tuple(rules), default=None)
    result = PtqResult(tree, (), QuantConfig(), stored=given)
    sp = serving.convert(fn, config, result, *args, **kwargs)
    # act-order weights: the matmul takes its inputs in the stored rows' order
    orders = {
        path: checkpoint.input_orders.get(found[i][0][: -len(".weight")])
        for path, i in paths_of.items()
    }
    weights = {
        path: {**arrays, "input_order": jnp.asarray(orders[path])}
        if orders.get(path) is not None
        else arrays
        for path, arrays in sp.weights.items()
    }
    return sp.replace(weights=weights), config
