"""Which platform's form is staged: chosen when traced, checked when lowered.

Some of qbits' computations have one form per platform, for speed on that
platform's compiler (XLA:CPU's reductions and kernels, cuBLASLt's GEMM
layouts); every form gives the same numbers, except that a GPU compiler
needs one of them to keep a narrowing cast (:mod:`qbits._formats`).
``jax.lax.platform_dependent`` stages all the forms and picks one when the
program is lowered; that costs tracing every form, and a ``cond`` that
every transformation walks: a third of the time to trace a quantized
matmul with its gradients.

:func:`per_platform` stages one form instead, when the platform is known
as the program is traced: the platforms :func:`lowering_platforms` names,
else the CPU where it is JAX's default backend. The staged form carries a
mark that lowering checks, so a program traced for one platform and
lowered for another (``.lower(lowering_platforms=...)``, ``jax.export``)
is refused with what to do, never run in the other's form. On any other
default backend, and for several platforms at once, every form is staged
as ``platform_dependent`` does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax import lax
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

from qbits._errors import InvalidArgumentError

__all__ = ["lowering_platforms", "per_platform", "traced_for_p"]

_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


def _state() -> Any:
    """The chosen platforms: a JAX config state, part of every trace's key.

    JAX caches what it traced (``jit``, ``custom_vjp`` rules) keyed by the
    config states of its trace context: a function traced for the CPU is
    traced again inside :func:`lowering_platforms`. None where this JAX has
    no such states: then every form is always staged.
    """
    try:
        from jax._src import config as jax_config

        return jax_config.string_or_object_state(
            "qbits_lowering_platforms",
            None,
            "The platforms qbits traces a per-platform computation for.",
            include_in_jit_key=True,
            include_in_trace_context=True,
        )
    except (ImportError, AttributeError, TypeError):  # pragma: no cover
        return None


_CHOSEN = _state()


@contextlib.contextmanager
def lowering_platforms(*platforms: str) -> Iterator[None]:
    """Traces qbits' computations for these platforms (where lowered).

    qbits traces a computation that has a form per platform in the form of
    the platform its program will be lowered for: by default the CPU where
    that is JAX's default backend (a lowering for another platform is then
    refused); inside this block, the platforms named. Name the platforms
    when a program is lowered for other ones than the default backend's:
    a deviceless compile for a GPU on a CPU machine, ``jax.export`` for
    several platforms. One platform stages its form only; several stage
    every form, and the compiler picks.

    Args:
      *platforms: ``"cpu"``, ``"cuda"``, ``"rocm"`` or ``"tpu"``, as in
        ``jax.jit(f).trace(...).lower(lowering_platforms=...)``.

    Raises:
      InvalidArgumentError: For no platform or an unknown one.

    Example:
      >>> import jax, jax.numpy as jnp, qbits, qbits.hlo
      >>> dg = qbits.dot_general("int8_fwd")
      >>> f = jax.jit(lambda x, w: dg(x, w, (((1,), (0,)), ((), ()))))
      >>> x = jnp.ones((8, 16))
      >>> with qbits.hlo.lowering_platforms("cuda"):
      ...     text = f.trace(x, x.T).lower(lowering_platforms=("cuda",)).as_text()
      >>> "dot_general" in text
      True
    """
    unknown = [p for p in platforms if p not in _PLATFORMS]
    if not platforms or unknown:
        raise InvalidArgumentError(
            "qbits.hlo.lowering_platforms",
            "platforms",
            platforms,
            f"one or more of {', '.join(map(repr, _PLATFORMS))}",
        )
    if _CHOSEN is None:  # pragma: no cover (every form is staged)
        yield
        return
    with _CHOSEN(tuple(platforms)):
        yield


def _traced_for() -> str | None:
    """The one platform being traced for, or None (every form staged)."""
    if _CHOSEN is None:  # pragma: no cover
        return None
    chosen = _CHOSEN.value
    if chosen is not None:
        return chosen[0] if len(chosen) == 1 else None
    return "cpu" if jax.default_backend() == "cpu" else None


def per_platform(
    *args: Any,
    cpu: Callable[..., Any],
    default: Callable[..., Any],
    cuda: Callable[..., Any] | None = None,
) -> Any:
    """``lax.platform_dependent(*args, cpu=, cuda=, default=)``, one form staged.

    Every form must give the same numbers on every platform (only their
    speed differs), or be right on the platforms it is chosen for whatever
    the lowering (the mark refuses the others). One form differs by
    design: XLA's FP8 form on GPUs rounds the scales' product and the
    output to bfloat16 (:mod:`qbits.ops._matmul`); tests/ops/test_lowering.py
    runs the GPU's forms on the CPU against the CPU's.
    """
    platform = _traced_for()
    if platform is None:
        branches = {"cpu": cpu} if cuda is None else {"cpu": cpu, "cuda": cuda}
        return lax.platform_dependent(*args, default=default, **branches)
    if platform == "cpu":
        branch = cpu
    elif platform == "cuda" and cuda is not None:
        branch = cuda
    else:
        branch = default
    out = branch(*args)
    return jax.tree.map(lambda y: traced_for_p.bind(y, platform=platform), out)


def _check(ctx: Any, x: Any, *, platform: str) -> list[Any]:
    lowering = tuple(ctx.module_context.platforms)
    if lowering != (platform,):
        names = ", ".join(map(repr, lowering))
        raise InvalidArgumentError(
            "qbits",
            "lowering_platforms",
            lowering,
            f"({platform!r},), the platform this program was traced for",
            why=(
                "qbits traced the form of one platform of a computation that "
                "has one per platform; trace and lower the function inside "
                f"`with qbits.hlo.lowering_platforms({names}):`"
            ),
        )
    return [x]


# The staged form's mark: the value itself, checked when lowered. It emits
# nothing, so the compiler sees the form alone.
traced_for_p = jex_core.Primitive("qbits_traced_for")
traced_for_p.def_impl(lambda x, *, platform: x)
traced_for_p.def_abstract_eval(lambda x, *, platform: x)
ad.deflinear2(
    traced_for_p,
    lambda ct, x, *, platform: [traced_for_p.bind(ct, platform=platform)],
)
batching.defvectorized(traced_for_p)
mlir.register_lowering(traced_for_p, _check)
