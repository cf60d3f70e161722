"""The example models: a character-level transformer LM and an MLP classifier.

Both are plain Flax nnx models (their forward passes know nothing about
qbits); the training loop quantizes them with :func:`qbits.nnx.quantize`, so
every ``nnx.Linear``, ``nnx.LinearGeneral`` and both attention einsums
follow the config. The embedding lookup is a gather, not a matmul, and stays
float. The LM also decodes token by token with a KV cache
(:meth:`TransformerLM.init_cache`, :meth:`TransformerLM.decode`; stored as a
:class:`qbits.kvcache.CacheConfig` says), which :func:`qbits.kvcache.generate`
drives.

Layer paths (for per-layer rules, see ``qbits inspect``):

- ``lm``: ``blocks/<i>/attn/{query,key,value,out,qk,pv}``,
  ``blocks/<i>/mlp/{fc1,fc2}``, ``head``.
- ``mlp``: ``layers/<i>`` (hidden layers), ``head``.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import flax.nnx as nnx
import jax
import numpy as np

from qbits import kvcache
from qbits._errors import InvalidArgumentError

__all__ = ["MODELS", "SIZES", "Classifier", "ModelSpec", "TransformerLM", "spec"]

MODELS = ("lm", "mlp")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The sizes and training hyperparameters of an example model.

    Every config trained in one comparison uses the same spec (the float32
    baseline included): nothing here is tuned per config.

    Attributes:
      model: ``"lm"`` or ``"mlp"``.
      width: ``d_model`` of the LM, hidden width of the MLP.
      depth: Transformer blocks, or hidden layers of the MLP.
      heads: Attention heads (``lm``).
      context: Characters per training sequence (``lm``).
      batch: Sequences (``lm``) or examples (``mlp``) per step.
      steps: Default number of training steps.
      lr: Peak AdamW learning rate (linear warm-up, cosine decay).
      eval_batches: Batches of held-out data in each evaluation.
      evals: Evaluations during training (for the curves), the last at the end.
      fast_compile: Compile without XLA's optimizations: seconds less to
        start, slower steps (the ``tiny`` sizes, which run a few steps).
      scan: The LM's blocks are stacked with ``nnx.vmap`` and run with
        ``nnx.scan`` (one traced block however deep; the ``deep`` size).
      optimizer: ``"adamw"`` (float32 states), ``"adamw8bit"`` or
        ``"adamw4bit"`` (:func:`qbits.optim.adamw`'s 8-bit dynamic and
        4-bit states).

    Example:
      >>> from qbits._experiments import spec
      >>> spec("lm").width, spec("lm", "tiny").width
      (128, 16)
    """

    model: str
    width: int
    depth: int
    heads: int
    context: int
    batch: int
    steps: int
    lr: float
    eval_batches: int = 8
    evals: int = 5
    fast_compile: bool = False
    scan: bool = False
    optimizer: str = "adamw"


SIZES: dict[tuple[str, str], ModelSpec] = {
    ("lm", "default"): ModelSpec("lm", 128, 2, 4, 64, 32, 800, 3e-3),
    ("lm", "tiny"): ModelSpec("lm", 16, 1, 2, 16, 4, 4, 3e-3, 1, 1, True),
    ("lm", "deep"): ModelSpec("lm", 64, 12, 4, 64, 32, 300, 2e-3, scan=True),
    ("mlp", "default"): ModelSpec("mlp", 256, 2, 1, 1, 256, 400, 3e-3),
    ("mlp", "tiny"): ModelSpec("mlp", 16, 1, 1, 1, 16, 4, 3e-3, 1, 1, True),
}


def spec(model: str, size: str = "default") -> ModelSpec:
    """The :class:`ModelSpec` of ``model`` at ``size``.

    Sizes: ``default``; ``tiny``, for smoke tests (it runs in seconds and
    learns little); for the LM, ``deep``: 12 blocks, stacked and scanned.

    Raises:
      ValueError: For an unknown model or size (the message lists them).

    Example:
      >>> from qbits._experiments import spec
      >>> spec("mlp").batch
      256
    """
    # isinstance first: a list (``size: [tiny]`` in a sweep) is not hashable.
    if not isinstance(model, str) or model not in MODELS:
        raise ValueError(f"unknown model {model!r}; expected one of: lm, mlp")
    if not isinstance(size, str) or (model, size) not in SIZES:
        sizes = ", ".join(s for m, s in SIZES if m == model)
        raise ValueError(f"unknown size {size!r} for {model}; expected one of: {sizes}")
    return SIZES[model, size]


class _Mlp(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(width, 4 * width, rngs=rngs)
        self.fc2 = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(jax.nn.gelu(self.fc1(x)))


class _Block(nnx.Module):
    def __init__(self, width: int, heads: int, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(width, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            heads, width, decode=False, deterministic=True, rngs=rngs
        )
        self.norm2 = nnx.LayerNorm(width, rngs=rngs)
        self.mlp = _Mlp(width, rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x), mask=mask)
        return x + self.mlp(self.norm2(x))


class TransformerLM(nnx.Module):
    """A small decoder-only (pre-norm, GPT-style) character-level transformer.

    Args:
      vocab: Number of distinct characters.
      spec: The sizes (``width``, ``depth``, ``heads``, ``context``).
      rngs: Initialisation keys.

    Example:
      >>> import flax.nnx as nnx
      >>> from qbits._experiments import TransformerLM, spec
      >>> make = lambda: TransformerLM(10, spec("lm", "tiny"), rngs=nnx.Rngs(0))
      >>> lm = nnx.eval_shape(make)  # the graph only, no parameters computed
      >>> tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
      >>> [row.path for row in qbits.nnx.layer_table(lm, "int8", tokens).rows]
      ... # doctest: +NORMALIZE_WHITESPACE
      ['blocks/0/attn/query', 'blocks/0/attn/key', 'blocks/0/attn/value',
       'blocks/0/attn/qk', 'blocks/0/attn/pv', 'blocks/0/attn/out',
       'blocks/0/mlp/fc1', 'blocks/0/mlp/fc2', 'head']
    """

    def __init__(self, vocab: int, spec: ModelSpec, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, spec.width, rngs=rngs)
        self.pos = nnx.Param(
            0.02 * jax.random.normal(rngs.params(), (spec.context, spec.width))
        )
        self.scan = spec.scan
        if spec.scan:

            @nnx.split_rngs(splits=spec.depth)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def stacked(rngs: nnx.Rngs) -> _Block:
                return _Block(spec.width, spec.heads, rngs)

            self.blocks = stacked(rngs)
        else:
            self.blocks = nnx.List(
                [_Block(spec.width, spec.heads, rngs) for _ in range(spec.depth)]
            )
        self.norm = nnx.LayerNorm(spec.width, rngs=rngs)
        self.head = nnx.Linear(spec.width, vocab, rngs=rngs)

    def _check_decodes(self, owner: str) -> None:
        """Raises unless this model can decode with a KV cache."""
        if self.scan:
            raise InvalidArgumentError(
                owner,
                "model",
                "TransformerLM with scanned blocks",
                "a TransformerLM whose blocks are a list (sizes default and tiny)",
                why="the deep size runs its blocks under nnx.scan, which has no "
                "KV cache yet",
            )
        if getattr(self, "qbits", None) is not None:
            raise InvalidArgumentError(
                owner,
                "model",
                "a quantized copy (qbits.nnx.quantize or a serving copy)",
                "the float TransformerLM",
                why="decoding calls the layers directly, outside the engine, so "
                "its matmuls would not be quantized; the cache's own config is "
                "given to init_cache",
            )

    def init_cache(self, batch: int, config: Any = None) -> tuple[kvcache.KVCache, ...]:
        """An empty KV cache for :meth:`decode`: one per block, ``context`` positions.

        Args:
          batch: Sequences decoded together.
          config: How keys and values are stored: a
            :class:`qbits.kvcache.CacheConfig`, ``None`` (float), a cache
            preset name (``"kv_int8"``) or a YAML file.

        Returns:
          A tuple of :class:`qbits.kvcache.KVCache`, one per block.

        Raises:
          InvalidArgumentError: For a bad config, or a model that has no KV
            cache: scanned blocks (size ``deep``), or a quantized copy of
            the model (decoding runs the float layers).

        Example:
          >>> import flax.nnx as nnx
          >>> from qbits._experiments import TransformerLM, spec
          >>> make = lambda: TransformerLM(10, spec("lm", "tiny"), rngs=nnx.Rngs(0))
          >>> lm = nnx.eval_shape(make)  # the graph only: caches need no weights
          >>> cache = lm.init_cache(2, "kv_int8")
          >>> len(cache), cache[0].keys.qvalue.shape, cache[0].keys.qvalue.dtype
          (1, (2, 16, 2, 8), dtype('int8'))
        """
        owner = "TransformerLM.init_cache"
        self._check_decodes(owner)
        config = kvcache._as_cache_config(owner, config)
        context, dtype = self.pos.shape[0], self.pos.dtype
        return tuple(
            kvcache.KVCache.create(
                config, batch, context, b.attn.num_heads, b.attn.head_dim, dtype
            )
            for b in self.blocks
        )

    def decode(
        self, tokens: jax.Array, cache: tuple[kvcache.KVCache, ...]
    ) -> tuple[jax.Array, tuple[kvcache.KVCache, ...]]:
        """Logits of new tokens after the cached ones, and the grown cache.

        The same computation as :meth:`__call__` over the whole sequence,
        one chunk at a time: ``tokens`` sit at positions ``cache length ..
        cache length + n - 1``; each block appends their keys and values to
        its cache (quantized once, as the cache's config says) and attends
        over everything the cache holds (:func:`qbits.kvcache.attend`).

        Args:
          tokens: int tokens ``[batch, n]``, each in ``0 .. vocab - 1``:
            the prompt (prefill), then one token at a time. Ids are checked
            where they are concrete; traced (under ``jit``, as
            :func:`qbits.kvcache.generate` runs it, having checked its
            prompt) they are not: an id ``>= vocab`` embeds as NaN and a
            negative one counts from the end (``nnx.Embed``'s lookup).
          cache: What :meth:`init_cache` (or the previous call) returned.
            Under ``jit`` the caller keeps the cache length plus ``n`` within
            the context length; outside ``jit`` more is an error.

        Returns:
          ``(logits [batch, n, vocab], cache)``.

        Raises:
          InvalidArgumentError: For a cache that is not this model's, tokens
            that do not fit it (not integer, too many, or ids outside the
            vocabulary), or a model without a KV cache (see
            :meth:`init_cache`).

        Example:
          A prompt of 3 tokens, then one more (shapes only, here; see
          :func:`qbits.kvcache.generate` for the decoding loop):

          >>> import flax.nnx as nnx
          >>> from qbits._experiments import TransformerLM, spec
          >>> make = lambda: TransformerLM(10, spec("lm", "tiny"), rngs=nnx.Rngs(0))
          >>> lm = nnx.eval_shape(make)
          >>> decode = lambda m, t, c: m.decode(t, c)
          >>> prompt = jax.ShapeDtypeStruct((2, 3), jnp.int32)
          >>> logits, cache = nnx.eval_shape(decode, lm, prompt, lm.init_cache(2))
          >>> next_token = jax.ShapeDtypeStruct((2, 1), jnp.int32)
          >>> logits, cache = nnx.eval_shape(decode, lm, next_token, cache)
          >>> logits.shape, cache[0].keys.shape
          ((2, 1, 10), (2, 16, 2, 8))
        """
        owner = "TransformerLM.decode"
        self._check_decodes(owner)
        blocks = list(self.blocks)
        if not (
            isinstance(cache, tuple)
            and len(cache) == len(blocks)
            and all(isinstance(c, kvcache.KVCache) for c in cache)
        ):
            raise InvalidArgumentError(
                owner,
                "cache",
                type(cache).__name__,
                f"the tuple of {len(blocks)} KVCache that init_cache returns",
            )
        context = self.pos.shape[0]
        shape = getattr(tokens, "shape", None)
        if (
            shape is None
            or len(shape) != 2
            or not jax.numpy.issubdtype(tokens.dtype, jax.numpy.integer)
            or not 1 <= shape[1] <= context
        ):
            raise InvalidArgumentError(
                owner,
                "tokens",
                tokens if shape is None else f"{tokens.dtype}{list(shape)}",
                f"int tokens [batch, n] with 1 <= n <= {context} (the context)",
            )
        vocab = self.embed.num_embeddings
        if not isinstance(tokens, jax.core.Tracer):  # traced: see Args
            ids = np.asarray(tokens)
            bad = np.argwhere((ids < 0) | (ids >= vocab))
            if bad.size:
                shown = [f"tokens{list(map(int, at))} = {ids[tuple(at)]}"
                         for at in bad[:4]]  # fmt: skip
                more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
                raise InvalidArgumentError(
                    owner,
                    "tokens",
                    f"{ids.dtype.name}{list(shape)}",
                    f"token ids in 0..{vocab - 1} (the model's vocabulary)",
                    why=f"ids outside the vocabulary: {', '.join(shown)}{more}",
                )
        n = shape[1]
        start = cache[0].length
        positions = jax.lax.dynamic_slice_in_dim(self.pos[...], start, n)
        x = self.embed(tokens) + positions
        grown = []
        for block, c in zip(blocks, cache, strict=True):
            attn = block.attn
            h = block.norm1(x)
            c = c.append(attn.key(h), attn.value(h))
            x = x + attn.out(kvcache.attend(attn.query(h), c))
            x = x + block.mlp(block.norm2(x))
            grown.append(c)
        return self.head(self.norm(x)), tuple(grown)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Next-character logits ``[batch, length, vocab]`` of int ``tokens``."""
        length = tokens.shape[-1]
        x = self.embed(tokens) + self.pos[:length]
        mask = nnx.make_causal_mask(tokens)
        if self.scan:

            @nnx.scan(in_axes=(0, nnx.Carry, None), out_axes=nnx.Carry)
            def run(block: _Block, x: jax.Array, mask: jax.Array) -> jax.Array:
                return block(x, mask)

            x = run(self.blocks, x, mask)
        else:
            for block in self.blocks:
                x = block(x, mask)
        return self.head(self.norm(x))


class Classifier(nnx.Module):
    """An MLP classifier: ``depth`` hidden layers of ``width`` with GELU.

    Args:
      features: Input features.
      classes: Output classes.
      spec: The sizes (``width``, ``depth``).
      rngs: Initialisation keys.

    Example:
      >>> import flax.nnx as nnx
      >>> from qbits._experiments import Classifier, spec
      >>> net = nnx.eval_shape(
      ...     lambda: Classifier(8, 3, spec("mlp", "tiny"), rngs=nnx.Rngs(0))
      ... )
      >>> x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
      >>> [row.path for row in qbits.nnx.layer_table(net, "none", x).rows]
      ['layers/0', 'head']
    """

    def __init__(self, features: int, classes: int, spec: ModelSpec, *, rngs):
        widths = [features] + [spec.width] * spec.depth
        self.layers = nnx.List(
            [nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(widths)]
        )
        self.head = nnx.Linear(widths[-1], classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Class logits ``[batch, classes]`` of features ``[batch, features]``."""
        for layer in self.layers:
            x = jax.nn.gelu(layer(x))
        return self.head(x)
