"""Training steps at GPU sizes: what the GPU benchmark times and inspects.

:func:`gpu_step` makes two, each with bf16 parameters and activations and
one SGD update, for bf16 (``preset=None``) or any config:

* ``"block"``: an LLM's MLP block, 4096 -> 16384 -> 4096 (GELU, no biases)
  on 8192 tokens, its two matmuls ``qbits.dot_general``'s;
* ``"lm"``: the example transformer (:class:`TransformerLM`) at d_model
  2048, 8 blocks, 16 heads, 4 sequences of 2048 tokens, every matmul
  quantized by :func:`qbits.nnx.quantize` (attention's einsums included).

``benchmarks/train_step.py --gpu`` times them against bf16 and
``qbits inspect CONFIG --target h100`` compiles them for a GPU on any
machine (:func:`qbits.hlo.program`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import qbits
from qbits._errors import InvalidArgumentError
from qbits._experiments._models import ModelSpec, TransformerLM

__all__ = ["LM_RECIPES", "gpu_step"]

_VOCAB = 256

#: The example LM's GPU recipes, by name (``gpu_step("lm", "fp8_proj")``,
#: ``benchmarks/train_step.py --model lm --variants``): a preset on every
#: weight matmul, attention's two einsums (``q k^T`` and ``p v``, activation
#: x activation) left in bf16. Without a fused attention kernel a GPU writes
#: their ``[batch, heads, S, S]`` operands to memory; quantizing them (an
#: amax pass, a cast writing the codes in both layouts their GEMMs take, the
#: same for their gradients) moves more bytes than their 8-bit GEMMs save
#: (``docs/guides/performance.md``). Numerics: those two matmuls are those of
#: bf16 (``examples/fp8_attn_float.yaml`` is ``fp8_proj`` as a rules file).
LM_RECIPES = {
    f"{preset}_proj": qbits.QuantConfig(
        rules=(qbits.Rule(r".*attn/(qk|pv)", None),), default=preset
    )
    for preset in ("fp8", "fp8_delayed")
}
_DN = (((1,), (0,)), ((), ()))

Step = tuple[Callable[[], Callable[..., Any]], tuple[Any, ...]]


def _sgd(lr: float, p: jax.Array, g: jax.Array) -> jax.Array:
    """One SGD update in float32, stored in the parameter's dtype."""
    return (p.astype(jnp.float32) - lr * g.astype(jnp.float32)).astype(p.dtype)


def _config(preset: Any) -> Any:
    return (
        None
        if preset is None
        else qbits.config._as_dot_general_config(
            "qbits._experiments.block_step", preset
        )
    )


def _block(
    preset: Any,
    tokens: int = 8192,
    d_model: int = 4096,
    d_ff: int = 16384,
    lr: float = 1e-3,
) -> Step:
    """The MLP block's training step with ``preset`` (``None``: bf16).

    Args:
      preset: A config, a preset name or a YAML file of one config; ``None``
        for bf16.
      tokens: Rows of the activations.
      d_model: The block's input and output width.
      d_ff: Its hidden width.
      lr: SGD's learning rate.

    Returns:
      ``(make, args)``: ``make()`` is a fresh ``jax.jit`` of the step (for
      timing a compile), ``args`` its arguments (random bf16 weights and
      tokens; the scale state of a stateful config).
    """
    config = _config(preset)
    stateful = config is not None and config.needs_state

    def dot(i: int, state: Any, key: Any) -> Any:
        if config is None:
            return jax.lax.dot_general
        for _ in range(i):  # the i-th link of a key chain (one kernel for all)
            key = qbits.numerics.next_key(key)
        dg = qbits.dot_general(config, key if config.needs_key else None)
        return functools.partial(dg, state=state[f"w{i}"]) if stateful else dg

    def loss(params: Any, state: Any, key: Any, x: Any, y: Any) -> Any:
        h = jax.nn.gelu(dot(1, state, key)(x, params["w1"], _DN))
        out = dot(2, state, key)(h, params["w2"], _DN)
        return jnp.mean(jnp.square(out.astype(jnp.float32) - y))

    def step(params: Any, state: Any, key: Any, x: Any, y: Any) -> Any:
        grads, new_state = jax.grad(loss, argnums=(0, 1))(params, state, key, x, y)
        return jax.tree.map(functools.partial(_sgd, lr), params, grads), new_state

    k = jax.random.split(jax.random.key(0), 5)
    bf16 = jnp.bfloat16
    params = {
        "w1": (jax.random.normal(k[0], (d_model, d_ff)) / d_model**0.5).astype(bf16),
        "w2": (jax.random.normal(k[1], (d_ff, d_model)) / d_ff**0.5).astype(bf16),
    }
    x = jax.random.normal(k[2], (tokens, d_model)).astype(bf16)
    y = jax.random.normal(k[3], (tokens, d_model))
    state = {}
    if stateful:
        dg = qbits.dot_general(config)
        hidden = jax.ShapeDtypeStruct((tokens, d_ff), bf16)
        state = {
            "w1": dg.init_state(x, params["w1"], _DN),
            "w2": dg.init_state(hidden, params["w2"], _DN),
        }
    return (lambda: jax.jit(step)), (params, state, k[4], x, y)


def _lm(
    preset: Any,
    batch: int = 4,
    context: int = 2048,
    width: int = 2048,
    depth: int = 8,
    heads: int = 16,
    lr: float = 1e-3,
) -> Step:
    """The example transformer's training step with ``preset`` (``None``: bf16).

    Args:
      preset: A config, a preset name, a rules YAML file, a name of
        :data:`LM_RECIPES`, or ``None``.
      batch: Sequences per step.
      context: Tokens per sequence.
      width: d_model.
      depth: Blocks.
      heads: Attention heads.
      lr: SGD's learning rate.

    Returns:
      ``(make, args)`` as for the block; ``args`` is the model's nnx
      state (bf16 parameters, scale state) and a batch of token ids.
    """
    if isinstance(preset, str) and preset in LM_RECIPES:
        preset = LM_RECIPES[preset]
    spec = ModelSpec("lm", width, depth, heads, context, batch, steps=1, lr=lr)
    k = jax.random.split(jax.random.key(0), 2)
    x = jax.random.randint(k[0], (batch, context), 0, _VOCAB)
    y = jax.random.randint(k[1], (batch, context), 0, _VOCAB)
    lm = TransformerLM(_VOCAB, spec, rngs=nnx.Rngs(0))
    params = nnx.state(lm, nnx.Param)
    nnx.update(lm, jax.tree.map(lambda a: a.astype(jnp.bfloat16), params))
    for _, module in nnx.iter_modules(lm):  # compute in bf16 (flax: float32)
        if hasattr(module, "dtype"):
            module.dtype = jnp.bfloat16
    quantized = preset is not None
    if quantized:
        # A delayed-scaling state starts from a sample batch's amaxes, which
        # quantize computes eagerly: 1 x 128 tokens, not 20 GB of attention
        # probabilities on a CPU (a deviceless compile at the GPU size).
        sample = x[:1, : min(context, 128)]
        lm = qbits.nnx.quantize(lm, preset, sample, rngs=nnx.Rngs(quant=0))
    graphdef, state = nnx.split(lm)
    wrt = nnx.DiffState(
        0, (nnx.Param, qbits.nnx.ScaleState) if quantized else nnx.Param
    )

    def loss(model: Any, x: Any, y: Any) -> Any:
        logits = model(x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step(state: Any, x: Any, y: Any) -> Any:
        model = nnx.merge(graphdef, state)
        grads = nnx.grad(loss, argnums=wrt)(model, x, y)
        if quantized:  # delayed scaling: the state's "gradient" is its new value
            grads = qbits.nnx.update_state(model, grads)
        params = nnx.state(model, nnx.Param)
        nnx.update(model, jax.tree.map(functools.partial(_sgd, lr), params, grads))
        return nnx.state(model)

    return (lambda: jax.jit(step)), (state, x, y)


_STEPS = {"block": _block, "lm": _lm}


def gpu_step(model: str, preset: Any, **sizes: int) -> Step:
    """A training step at a GPU's size, with ``preset`` (``None``: bf16).

    Args:
      model: ``"block"`` (an LLM's MLP block: sizes ``tokens``, ``d_model``,
        ``d_ff``) or ``"lm"`` (the example transformer: ``batch``,
        ``context``, ``width``, ``depth``, ``heads``); see the module.
      preset: A config, a preset name or a YAML file (rules for the LM, one
        config for the block), for the LM a name of :data:`LM_RECIPES`, or
        ``None`` for bf16.
      **sizes: Sizes other than the GPU ones (and ``lr``).

    Returns:
      ``(make, args)``: ``make()`` is a fresh ``jax.jit`` of the step (for
      timing a compile), ``args`` its arguments (random bf16 weights, the
      scale state of a stateful config, a batch).

    Raises:
      InvalidArgumentError: For an unknown model.

    Example:
      >>> make, args = qbits._experiments.gpu_step(
      ...     "block", "int8", tokens=32, d_model=16, d_ff=32)
      >>> params, state = make()(*args)
      >>> params["w1"].dtype
      dtype(bfloat16)
    """
    if model not in _STEPS:
        raise InvalidArgumentError(
            "qbits._experiments.gpu_step", "model", model, "'block' or 'lm'"
        )
    return _STEPS[model](preset, **sizes)
