"""How the engine names the matmuls it finds.

A weight matmul is named by the module path of the parameter that feeds it
(``blocks_0/mlp/fc1``; with the parameter's own name where one module
multiplies with several parameters). A matmul of two activations is named
after the common scope of the modules that produced its operands, plus the
einsum's subscripts where the jaxpr records them (Flax's attention einsums
are ``qk`` and ``pv``). Later uses of a name get ``#2``, ``#3``...
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax

__all__ = [
    "ATTENTION",
    "base_name",
    "common",
    "flipped",
    "label",
    "name_sites",
    "param_path",
]


def name_sites(sites: list[Any]) -> None:
    """Gives every site its rule path (module path, or module/parameter)."""
    by_module: dict[tuple[str, ...], set[tuple[str, ...]]] = {}
    for site in sites:
        for w in site.weights:
            by_module.setdefault(w.path[:-1], set()).add(w.path)
    for site in sites:
        weights = sorted(site.weights, key=lambda w: w.path)
        if weights:
            w = weights[0]
            module = w.path[:-1]
            parts = w.path if len(by_module[module]) > 1 or not module else module
            site.path = "/".join(parts)
        else:
            scope = "/".join(site.scope)
            label = ATTENTION.get(site.label) or site.label or site.primitive
            site.path = f"{scope}/{label}" if scope else label
    seen: dict[str, int] = {}
    kept: set[tuple[str, str, str]] = set()
    for site in sites:
        # A model's own function may hold one matmul several times (its
        # per-platform branches): one kept matmul, one name.
        if site.frozen:
            key = (site.path, site.frozen, site.operands)
            if key in kept:
                continue
            kept.add(key)
        n = seen[site.path] = seen.get(site.path, 0) + 1
        if n > 1:
            site.path = f"{site.path}#{n}"


def base_name(name: str) -> str:
    """The name rules match: ``"mlp/fc1"`` for the second use ``"mlp/fc1#2"``."""
    return name.split("#", 1)[0]


def _key_name(key: Any) -> str | None:
    """A path entry's name; ``None`` for entries that name no module."""
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return None if key.name == "value" else key.name  # nnx Variable.value
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx)
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return str(key.key)
    return str(key)


def param_path(keys: Sequence[Any]) -> tuple[str, ...]:
    """``('Dense_0', 'kernel')`` for linen's ``['params']['Dense_0']['kernel']``.

    Keys that are paths themselves (haiku's and penzai's flat
    ``"block_0/mlp"``) are split at their ``/``.
    """
    names = [
        part
        for n in (_key_name(k) for k in keys)
        if n is not None
        for part in n.split("/")
        if part
    ]
    if len(names) > 1 and names[0] == "params":  # linen's variables dict
        names = names[1:]
    return tuple(names)


def label(name_stack: str) -> str:
    """The einsum subscripts a jaxpr's name stack ends with, or ``""``.

    A transformation's wrapper (``vmap(...)``) around them is dropped.
    """
    last = name_stack.rsplit("/", 1)[-1] if name_stack else ""
    while (found := re.fullmatch(r"\w+\((.*)\)", last)) is not None:
        last = found.group(1)
    return last if "->" in last else ""


# Flax's attention einsums (linen and nnx) and those of
# ``jax.nn.dot_product_attention`` (nnx's attention with a mask) by the names
# the layer tables give them: query . key, and weights . value.
ATTENTION = {
    "...qhd,...khd->...hqk": "qk",
    "...hqk,...khd->...qhd": "pv",
    "BTNH,BSNH->BNTS": "qk",
    "BNTS,BSNH->BTNH": "pv",
}


def _letters(sub: str, ndim: int) -> list[str] | None:
    """One name per axis of an operand written ``sub`` (``...`` expanded).

    Ellipsis axes are named by their distance from the ellipsis' end, so
    that broadcast axes of two operands get the same names.
    """
    if "..." not in sub:
        return list(sub) if len(sub) == ndim else None
    head, tail = sub.split("...", 1)
    n = ndim - len(head) - len(tail)
    if n < 0:
        return None
    return [*head, *(f"#{n - 1 - i}" for i in range(n)), *tail]


def flipped(label: str, eqn: Any) -> bool:
    """Whether a two-operand einsum's dot_general has its operands swapped.

    The einsum's subscripts are matched against the equation's dimension
    numbers both ways; ``True`` only when the swapped reading is the one
    that fits (an ambiguous einsum keeps JAX's order).
    """
    inputs, _, out = label.partition("->")
    written = inputs.split(",")
    if len(written) != 2:
        return False
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    ndims = [len(v.aval.shape) for v in eqn.invars[:2]]
    kept = set(out.replace("...", ""))

    def fits(a_sub: str, b_sub: str) -> bool:
        a, b = _letters(a_sub, ndims[0]), _letters(b_sub, ndims[1])
        if a is None or b is None:
            return False

        def is_kept(name: str) -> bool:
            return name.startswith("#") or name in kept

        return all(
            a[i] == b[j] and not is_kept(a[i]) for i, j in zip(lc, rc, strict=True)
        ) and all(a[i] == b[j] and is_kept(a[i]) for i, j in zip(lb, rb, strict=True))

    return fits(written[1], written[0]) and not fits(written[0], written[1])


def common(paths: frozenset[tuple[str, ...]]) -> tuple[str, ...]:
    """The longest common prefix of module paths."""
    if not paths:
        return ()
    items = list(paths)
    prefix = items[0]
    for p in items[1:]:
        n = 0
        while n < min(len(prefix), len(p)) and prefix[n] == p[n]:
            n += 1
        prefix = prefix[:n]
    return prefix
