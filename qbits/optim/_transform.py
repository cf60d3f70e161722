"""optax transformations whose moment states are stored quantized."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from qbits._errors import InvalidArgumentError, check_bool, check_int, check_mapping
from qbits.numerics import next_key
from qbits.optim._blockwise import (
    QuantizedMoment,
    check_format,
    dequantize,
    laid_out,
    quantize,
)

__all__ = ["QuantizedStates", "adamw", "quantize_states"]

#: The moment fields quantize_states knows, and whether each is signed:
#: optax's ScaleByAdamState (adam, adamw, nadam, amsgrad, yogi, ...),
#: ScaleByBeliefState (adabelief), ScaleByLionState (lion) and TraceState
#: (sgd with momentum).
MOMENTS: dict[str, bool] = {"mu": True, "nu": False, "trace": True}
_BLOCK_SIZES = {(8, "dynamic"): 256, (8, "linear"): 256, (8, "fp8"): 256}
_BLOCK_SIZES |= {(4, "dynamic"): 128, (4, "linear"): 128}


class QuantizedStates(NamedTuple):
    """The state of :func:`quantize_states`.

    Attributes:
      inner: The wrapped transformation's state, its moments'
        large leaves replaced by :class:`QuantizedMoment` s.
      key: The key of stochastic rounding (two uint32 words), advanced
        every step; ``None`` without stochastic rounding.

    Example:
      >>> import optax
      >>> tx = qbits.optim.quantize_states(optax.lion(1e-4), stochastic_rounding=True)
      >>> state = tx.init({"w": jnp.zeros((64, 64))})
      >>> type(state).__name__, state.key.shape, type(state.inner[0].mu["w"]).__name__
      ('QuantizedStates', (2,), 'QuantizedMoment')
    """

    inner: Any
    key: jax.Array | None


def _walk(state: Any, moments: Mapping[str, bool], fn: Callable[..., Any]) -> Any:
    """``state`` with ``fn(subtree, signed)`` applied to every moment field.

    Walks NamedTuples (optax's states), tuples, lists and dicts (chains,
    ``multi_transform``); anything else is left as it is.
    """
    fields = getattr(type(state), "_fields", None)
    if isinstance(state, tuple) and fields is not None:
        return type(state)(
            *(
                fn(v, moments[f]) if f in moments else _walk(v, moments, fn)
                for f, v in zip(fields, state, strict=True)
            )
        )
    if isinstance(state, (tuple, list)):
        return type(state)(_walk(v, moments, fn) for v in state)
    if isinstance(state, dict):
        return {k: _walk(v, moments, fn) for k, v in state.items()}
    return state


def _is_moment(x: Any) -> bool:
    return isinstance(x, QuantizedMoment)


def quantize_states(
    inner: optax.GradientTransformation,
    *,
    state_bits: int = 8,
    state_format: str = "dynamic",
    block_size: int | None = None,
    min_size: int = 4096,
    stochastic_rounding: bool = False,
    seed: int = 0,
    moments: Mapping[str, bool] | None = None,
) -> optax.GradientTransformationExtraArgs:
    """``inner`` with its moment states stored as codes and block scales.

    Each step dequantizes the moments to float32, runs ``inner``'s update
    on them and quantizes the new moments again (blockwise absmax,
    Dettmers et al. 2022), all inside the caller's ``jit``. The moments are
    the fields named in ``moments`` of the NamedTuple states inside
    ``inner``'s state (found through chains, tuples and dicts): by
    default ``mu`` and ``trace`` (signed) and ``nu`` (non-negative), the
    fields of optax's ``ScaleByAdamState`` (``adam``, ``adamw``,
    ``nadam``, ``amsgrad``, ``yogi``), ``ScaleByBeliefState``
    (``adabelief``), ``ScaleByLionState`` (``lion``) and ``TraceState``
    (``sgd`` with momentum). Factored moments (``adafactor``) and states
    with other names are not touched; a state with none of the fields is
    refused. A field marked non-negative must be: its map has no negative
    levels.

    Leaves with fewer than ``min_size`` elements (biases, norms; 4096 is
    bitsandbytes' ``min_8bit_size``) or no axes stay float32. The codes are
    laid out like their moment (so like its parameter), the scales along
    its first axis.

    Args:
      inner: An optax transformation that keeps moments.
      state_bits: 8 or 4.
      state_format: ``"dynamic"`` (bitsandbytes' dynamic map at 8 bits;
        torchao's 4-bit maps at 4), ``"linear"``, or ``"fp8"`` (E4M3 with a
        block scale, 8 bits); the maps are described in
        :class:`QuantizedMoment`.
      block_size: Elements per scale; default 256 at 8 bits (bitsandbytes'
        optimizers and torchao's fp8 states) and 128 at 4 bits (torchao).
      min_size: Leaves smaller than this stay float32.
      stochastic_rounding: Requantize with unbiased stochastic rounding
        (the key is kept in the state and advanced every step).
      seed: Seed of that key.
      moments: Field name -> signed, replacing the default table.

    Returns:
      An optax transformation; its state is a :class:`QuantizedStates`.

    Raises:
      InvalidArgumentError: For a format, size or table that does not fit,
        and (at ``init``) for an ``inner`` whose state has none of the
        moment fields.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> tx = qbits.optim.quantize_states(optax.adam(1e-3))
      >>> params = {"w": jnp.ones((64, 64)), "b": jnp.zeros(64)}
      >>> state = tx.init(params)
      >>> mu = state.inner[0].mu
      >>> mu["w"].codes.dtype, mu["w"].absmax.shape, mu["b"].dtype
      (dtype('uint8'), (16, 1), dtype('float32'))
      >>> with jax.numpy_dtype_promotion("standard"):  # optax's float ** int32
      ...     updates, state = jax.jit(tx.update)(params, state)
    """
    owner = "quantize_states"
    if not isinstance(inner, optax.GradientTransformation):
        raise InvalidArgumentError(
            owner, "inner", inner, "an optax GradientTransformation"
        )
    check_format(owner, state_format, state_bits)
    if block_size is None:
        block_size = _BLOCK_SIZES[state_bits, state_format]
    check_int(owner, "block_size", block_size, 2, 2**24)
    if state_bits == 4 and block_size % 2:
        raise InvalidArgumentError(owner, "block_size", block_size, "an even size")
    check_int(owner, "min_size", min_size, 0, 2**62)
    check_bool(owner, "stochastic_rounding", stochastic_rounding)
    check_int(owner, "seed", seed, 0, 2**32 - 1)
    if moments is not None:
        check_mapping(owner, "moments", moments, "a mapping of field name -> signed")
    table = dict(MOMENTS if moments is None else moments)
    if moments is not None:
        for name, signed in table.items():
            if not isinstance(name, str) or not isinstance(signed, bool):
                raise InvalidArgumentError(
                    owner, "moments", moments, "field names (str) -> signed (bool)"
                )
    inner = optax.with_extra_args_support(inner)

    def requantize(state: Any, key: jax.Array | None) -> Any:
        keys = [key]

        def leaf(x: Any, signed: bool) -> Any:
            if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
                return x
            if x.ndim == 0 or x.size < min_size:
                return x
            k = None
            if keys[0] is not None:
                k = keys[0] = next_key(keys[0])
            q = quantize(x, state_format, state_bits, signed, block_size, k)
            return laid_out(q, x)

        def moment(tree: Any, signed: bool) -> Any:
            return jax.tree.map(lambda x: leaf(x, signed), tree)

        return _walk(state, table, moment)

    def init_fn(params: Any) -> QuantizedStates:
        # nnx.Optimizer passes Variables; its updates pass their arrays. A
        # moment made from a Variable would sit inside one (a pytree as a
        # Variable's value, which nnx.Optimizer's update replaces by a State).
        state = inner.init(nnx.as_pure(params))
        found: list[str] = []
        _walk(state, table, lambda tree, signed: found.append("") or tree)
        if not found:
            raise InvalidArgumentError(
                owner,
                "inner",
                type(state).__name__,
                "a transformation whose state has a moment field: "
                + ", ".join(sorted(table)),
                why="its state has none (pass moments={field: signed} to name "
                "its fields)",
            )
        key = None
        if stochastic_rounding:
            key = jax.random.key_data(jax.random.key(seed))
        return QuantizedStates(requantize(state, None), key)

    def update_fn(
        updates: Any, state: QuantizedStates, params: Any = None, **extra: Any
    ) -> tuple[Any, QuantizedStates]:
        floats = jax.tree.map(
            lambda x: dequantize(x) if _is_moment(x) else x,
            state.inner,
            is_leaf=_is_moment,
        )
        updates, new = inner.update(updates, floats, params, **extra)
        key = None if state.key is None else next_key(state.key)
        return updates, QuantizedStates(requantize(new, key), key)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    *,
    mask: Any = None,
    state_bits: int = 8,
    state_format: str = "dynamic",
    block_size: int | None = None,
    min_size: int = 4096,
    stochastic_rounding: bool = False,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    """AdamW with 8-bit or 4-bit moments: ``optax.adamw`` over quantized states.

    The chain of ``optax.adamw`` (``scale_by_adam``, decoupled weight
    decay, the learning rate) with ``scale_by_adam``'s two moments stored
    by :func:`quantize_states`: 8-bit dynamic by default, as bitsandbytes'
    ``AdamW8bit``; ``state_bits=4`` for torchao's 4-bit states;
    ``state_format="fp8"`` for E4M3 states. The arguments before ``mask``
    are ``optax.adamw``'s; the others :func:`quantize_states`'.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> tx = qbits.optim.adamw(1e-3, state_bits=4)
      >>> params = {"w": jnp.ones((64, 128))}
      >>> state = tx.init(params)
      >>> state[0].inner.nu["w"].codes.shape  # two 4-bit codes a byte
      (64, 64)
      >>> with jax.numpy_dtype_promotion("standard"):  # optax's float ** int32
      ...     updates, state = jax.jit(tx.update)(params, state, params)
      >>> params = optax.apply_updates(params, updates)
    """
    return optax.chain(
        quantize_states(
            optax.scale_by_adam(b1=b1, b2=b2, eps=eps),
            state_bits=state_bits,
            state_format=state_format,
            block_size=block_size,
            min_size=min_size,
            stochastic_rounding=stochastic_rounding,
            seed=seed,
        ),
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )
