"""Arrays laid out like the array they belong to.

What qbits makes for a parameter (its scale state, its stored codes'
scales, its low-rank adapters) is created from shapes (``jnp.ones``, NumPy
on the host), which lay it out on one device or, under explicit mesh axes,
replicate it. :func:`like` lays such a value out as the parameter is: each
of its axes sharded as the parameter axis it stands for, replicated where
it stands for none (a history's steps, a per-tensor scale, an adapter's
rank).

Concrete arrays (outside ``jit``) are put on their parameter's mesh, auto
or explicit axes alike. Traced ones are resharded where the parameter's
type names explicit mesh axes (``AxisType.Explicit``); under auto axes XLA
propagates the layout itself, and inside ``shard_map`` the manual axes
need none.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

try:  # jax 0.10 has it, 0.11.2 not (then nothing is tied)
    from jax.experimental.shard_alike import shard_alike
except ImportError:  # pragma: no cover
    shard_alike = None

__all__ = ["abstract", "alike", "like", "max_on_shards", "spec_entries", "take"]


def _layout(x: Any) -> tuple[Any, tuple[Any, ...], bool] | None:
    """``(mesh, spec entry per axis, concrete)`` of ``x``, or ``None``.

    Traced (or abstract) arrays give only their explicit mesh axes.
    """
    ndim = len(getattr(x, "shape", ()))
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        s = getattr(x, "sharding", None)
        if not isinstance(s, NamedSharding):
            return None
        return s.mesh, _entries(s.spec, ndim), True
    s = getattr(x, "sharding", None) if isinstance(x, jax.ShapeDtypeStruct) else None
    if s is None:
        try:
            s = jax.typeof(x).sharding
        except (TypeError, AttributeError):
            return None
    if not isinstance(s, NamedSharding):
        return None
    return s.mesh, _explicit(s.mesh, _entries(s.spec, ndim)), False


def _entries(spec: Any, ndim: int) -> tuple[Any, ...]:
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    return tuple(None if e == () else e for e in entries)


def _explicit(mesh: Any, entries: tuple[Any, ...]) -> tuple[Any, ...]:
    """``entries`` with only the mesh's explicit axes (``None`` for others)."""
    explicit = {
        n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if t == AxisType.Explicit
    }  # fmt: skip

    def keep(e: Any) -> Any:
        names = e if isinstance(e, tuple) else (e,)
        return e if e is not None and all(n in explicit for n in names) else None

    return tuple(keep(e) for e in entries)


def spec_entries(x: Any) -> tuple[Any, ...] | None:
    """The explicit mesh axes of each axis of ``x`` (``None``: no mesh).

    Example:
      >>> from qbits._sharding import spec_entries
      >>> spec_entries(jnp.ones((2, 3))) is None  # one device, no mesh
      True
    """
    found = _layout(x)
    return None if found is None else _explicit(found[0], found[1])


def _size(mesh: Any, entry: Any) -> int:
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(mesh.shape[n] for n in names)


def like(value: Any, x: Any, axes: Sequence[int | None]) -> Any:
    """``value`` laid out as ``x``: its axis ``i`` as ``x``'s axis ``axes[i]``.

    ``None`` in ``axes`` replicates that axis; so does an axis whose size
    the mesh axes do not divide. A value whose ``x`` has no named layout
    comes back unchanged.

    Example:
      >>> from qbits._sharding import like
      >>> like(jnp.zeros(3), jnp.ones((2, 3)), (1,)).shape
      (3,)
    """
    found = _layout(x)
    if found is None:
        return value
    mesh, entries, concrete = found
    spec = []
    for n, a in zip(value.shape, axes, strict=True):
        e = None if a is None else entries[a]
        spec.append(e if e is not None and n % _size(mesh, e) == 0 else None)
    sharding = NamedSharding(mesh, P(*spec))
    if not isinstance(value, jax.core.Tracer):
        if concrete:
            return jax.device_put(value, sharding)
        value = jax.numpy.asarray(value)
    if all(e is None for e in spec):  # replicated, as created
        return value
    if AxisType.Explicit not in mesh.axis_types:  # a concrete auto-axes mesh
        return jax.lax.with_sharding_constraint(value, sharding)
    return jax.sharding.reshard(value, sharding)


def alike(x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x`` and ``y`` (of one shape) partitioned alike under auto mesh axes.

    A scale broadcast against the array it scales has no layout of its
    own: XLA's sharding propagation may lay the product out as a later
    user wants and move the (float) array there. Tied with
    ``shard_alike``, the product is made where the array lives. Nothing
    changes on one device, under explicit mesh axes (the types say where
    each value lives), inside ``shard_map``'s manual axes, or with a jax
    that has no ``shard_alike`` (0.11.2 has none: XLA then lays the product
    out itself, as before; the same numbers).

    Example:
      >>> from qbits._sharding import alike
      >>> [v.shape for v in alike(jnp.ones((2, 3)), jnp.zeros((2, 3)))]
      [(2, 3), (2, 3)]
    """
    if shard_alike is None or jax.device_count() == 1:
        return x, y
    types = getattr(jax.typeof(x).sharding.mesh, "axis_types", ())
    if any(t != AxisType.Auto for t in types):
        return x, y
    return shard_alike(x, y)


def abstract(x: Any) -> jax.ShapeDtypeStruct:
    """What to read an array as: its shape, dtype and, if it has one, sharding.

    A target whose arrays carry mesh shardings (placed with
    ``jax.device_put``, or ``jax.ShapeDtypeStruct(..., sharding=...)``) gets
    the arrays back with those ``NamedSharding`` s, on any mesh: Orbax reads
    each device's shard. Other arrays are read onto the default device.

    Example:
      >>> from qbits._sharding import abstract
      >>> abstract(jnp.ones((2, 3))).sharding is None
      True
    """
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        sharding = None
    return jax.ShapeDtypeStruct(tuple(x.shape), np.dtype(x.dtype), sharding=sharding)


def take(table: jax.Array, index: jax.Array) -> jax.Array:
    """``jnp.take(table, index, mode="clip")``, laid out as ``index``.

    A small table (a codebook's levels) looked up by codes: under explicit
    mesh axes JAX asks where the result lives; it lives with the codes.

    Example:
      >>> from qbits._sharding import take
      >>> take(jnp.array([0.5, 1.0]), jnp.array([1, 0, 5])).tolist()
      [1.0, 0.5, 1.0]
    """
    found = _layout(index)
    entries = None if found is None else _explicit(found[0], found[1])
    if not entries or all(e is None for e in entries):
        return jax.numpy.take(table, index, mode="clip")
    out = NamedSharding(found[0], P(*entries))  # type: ignore[index]
    return table.at[index].get(mode="clip", out_sharding=out)


def _names(entry: Any) -> tuple[str, ...]:
    return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def max_on_shards(
    local: Callable[[jax.Array], jax.Array],
    whole: Callable[[jax.Array], jax.Array],
    x: jax.Array,
    axes: Sequence[int],
) -> jax.Array | None:
    """A max over ``axes`` of ``x`` in one all-reduce, where explicit axes split them.

    ``local(block)`` is a maximum over ``axes`` (kept, size 1) of a block of
    ``x``; ``whole(x)`` the same of all of ``x``. Where explicit mesh axes
    shard some of ``axes``, each shard computes ``local`` of its block and
    one all-reduce (``pmax``) over all those mesh axes at once combines them;
    ``whole`` reduced over a tensor sharded over two mesh axes would take
    one all-reduce per axis (XLA's partitioner). A max is exact in any
    order: the result is ``whole(x)``, bit for bit, and so is its
    derivative (``whole``'s). ``None`` where no explicit axis shards
    ``axes`` (auto axes, one device): use ``whole``.

    Example:
      >>> from qbits._sharding import max_on_shards
      >>> m = lambda v: jnp.max(v, axis=0, keepdims=True)
      >>> max_on_shards(m, m, jnp.ones((4, 2)), (0,)) is None  # no mesh
      True
    """
    entries = spec_entries(x) if jax.device_count() > 1 else None
    if entries is None:
        return None
    reduced = tuple(n for a in axes for n in _names(entries[a]))
    if not reduced:
        return None
    spec = P(*entries)
    kept = P(*(None if i in axes else e for i, e in enumerate(entries)))
    used = {n for e in entries for n in _names(e)}
    mesh = jax.typeof(x).sharding.mesh
    on_shards = jax.shard_map(
        lambda block: lax.pmax(local(block), reduced),
        mesh=mesh, in_specs=spec, out_specs=kept, axis_names=used,
    )  # fmt: skip
    return _max_with_jvp(whole, on_shards, x)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _max_with_jvp(whole: Callable, on_shards: Callable, x: jax.Array) -> jax.Array:
    return on_shards(x)  # pmax has no derivative: whole's below


@_max_with_jvp.defjvp
def _max_with_jvp_jvp(
    whole: Callable, on_shards: Callable, primals: tuple, tangents: tuple
) -> tuple[jax.Array, jax.Array]:
    _, dt = jax.jvp(whole, primals, tangents)
    return _max_with_jvp(whole, on_shards, *primals), dt
