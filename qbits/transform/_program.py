"""Finding every matmul a function computes, and naming it.

A function is traced once to a jaxpr. Every equation of an op kind
(:data:`qbits.ops.KINDS`: ``dot_general``, ``conv_general_dilated`` and
``ragged_dot_general``, the grouped matmuls of ``lax.ragged_dot``) in it
(at any depth: inside ``jit``, ``scan``, ``remat``, ``cond``, ``while``
and ``shard_map`` bodies) is a *site*. A site is
named by the parameter that feeds it: parameters are the leaves of one
argument (the model's variables or state), and their paths are followed
through the operations that only move or re-type a weight (reshape,
transpose, casts, slices, a scan over stacked layers, a ``shard_map``
that hands each shard a block of it). An operand fed by a
parameter at ``blocks/attn/query/kernel`` makes the site
``blocks/attn/query`` (the module path; the parameter's own name is kept
where one module multiplies with several parameters). A site whose operands
are both activations (attention's two einsums) is named after the modules
whose matmuls produced its operands, plus the einsum's subscripts where the
jaxpr records them (``blocks/attn/btnh,bsnh->bnts``; Flax's own attention
einsums are ``blocks/attn/qk`` and ``blocks/attn/pv``). Where JAX hands such
an einsum's ``dot_general`` its operands in the other order than written,
the site says so (``flipped``): it is run swapped back.

Sites inside a ``custom_jvp`` or ``custom_vjp`` rule (a model's own
quantized function, or a hand-written gradient), inside other primitives
whose bodies cannot be re-run (``custom_transpose`` and the like) and inside a
``while_loop``'s condition are listed but kept as they are; so are
matmuls of two integer operands (exact, as ``lax`` computes them; an
integer operand times a float one is a site like any other, the integer
operand converted to floating point), matmuls of complex numbers and ragged
dots that :func:`qbits.ops.ragged_dot` does not quantize (a ragged
dimension contracted or batched, as in the weight gradients JAX derives;
group sizes per batch; a ``group_offset``). A ``dot_general`` that contracts no axis (an
elementwise product, such as a norm's scale) is not a matmul: it is
neither listed nor quantized.

Names are unique: where several matmuls get the same name (a layer called
twice, two uses of one weight), the later ones are ``name#2``,
``name#3``... in program order; rules that match ``name`` match them too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from qbits import ops
from qbits._errors import InvalidArgumentError
from qbits._jaxpr import scan_counts, shard_map_body
from qbits.transform._names import (
    base_name,
    common,
    flipped,
    name_sites,
    param_path,
)
from qbits.transform._names import label as einsum_label

__all__ = ["Program", "Site", "float_operands", "trace"]

# Primitives whose outputs are their first operand moved, re-typed or sliced:
# a weight stays a weight through them.
_MOVES = frozenset(
    (
        "convert_element_type", "reshape", "transpose", "broadcast_in_dim",
        "squeeze", "expand_dims", "copy", "copy_p", "slice", "dynamic_slice",
        "rev", "reduce_precision", "sharding_constraint", "mesh_cast",
        "reshard", "pvary", "real",
    )
)  # fmt: skip
# Multiple-result primitives that pass each operand through unchanged.
_PASS_EACH = frozenset(("device_put", "optimization_barrier"))
_CALLS = frozenset(("jit", "pjit", "closed_call", "core_call"))
_REMATS = frozenset(("remat2", "checkpoint"))
_CUSTOM = frozenset(
    ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin")
)
# At most this many producing modules are remembered per value: the scope of
# an activation x activation matmul is their common path prefix.
_MAX_ORIGINS = 8

Ctx = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Weight:
    """A parameter feeding an operand.

    Attributes:
      path: Its module path for the rules (``('blocks_0', 'mlp', 'w_in')``).
      keys: Its key path inside the parameters argument (to find the leaf).
      sliced: The scans (by ctx) that slice it per iteration (stacked
        layers); in the other scans around a use it is the same every
        iteration.
    """

    path: tuple[str, ...]
    keys: tuple[Any, ...] = dataclasses.field(default=(), compare=False)
    sliced: frozenset[Ctx] = dataclasses.field(default=frozenset(), compare=False)


@dataclasses.dataclass
class _Value:
    weights: frozenset[Weight] = frozenset()
    origins: frozenset[tuple[str, ...]] = frozenset()


_ACTIVATION = _Value()


@dataclasses.dataclass
class Site:
    """One matmul equation of the traced function.

    Attributes:
      ctx: Where the equation is: equation indices from the outermost jaxpr
        down through the bodies that hold it (and a ``cond``'s branch index).
      primitive: ``"dot_general"``, ``"conv_general_dilated"`` or
        ``"ragged_dot"`` (a ``ragged_dot_general`` equation).
      operands: The operand types, e.g. ``"f32[8,16] x f32[16,32]"``.
      lhs, rhs: The parameters feeding each operand (empty: activation).
      label: The einsum subscripts the jaxpr recorded, or ``""``.
      scope: For activation x activation sites, the common module path of
        the matmuls that produced the operands.
      frozen: Why the site cannot be replaced (``"custom_vjp"``...), or ``""``.
      loops: Lengths of the scans the site runs in, outermost first (a scan
        over stacked layers runs each of its matmuls once per layer).
      control: ``"cond"`` or ``"while"`` when the site runs in such a body
        (where scale state cannot be carried), else ``""``.
      mapped: Whether the site runs inside a ``shard_map`` body, on each
        shard's block of its operands (no per-site data crosses the body:
        scale state, stored weights, adapters, probes, observations).
      contracting: The contracting axes of each operand (``dot_general``).
      flipped: For an einsum of two activations: JAX hands ``dot_general``
        its operands in the other order than the einsum is written (the
        site is run swapped back, so that a config's ``lhs`` is the
        written first operand).
      integer: Whether both operands are integers (an integer matmul:
        exact, kept as it is). A matmul of an integer and a floating-point
        operand is quantized like any other, the integer operand converted
        to floating point first (:func:`float_operands`).
      unsupported: Why qbits cannot quantize the matmul (a ragged dot of
        another mode: ``qbits.ops.ragged_dot(...).unsupported``), or ``""``.
      path: The site's unique name (set by :func:`~._names.name_sites`).
      eqn: The jaxpr equation (its operand types and parameters).
    """

    ctx: Ctx
    primitive: str
    operands: str
    lhs: frozenset[Weight]
    rhs: frozenset[Weight]
    label: str
    scope: tuple[str, ...]
    frozen: str
    loops: tuple[int, ...] = ()
    control: str = ""
    mapped: bool = False
    contracting: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
    flipped: bool = False
    integer: bool = False
    unsupported: str = ""
    path: str = ""
    eqn: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def base(self) -> str:
        """The name the rules match: ``fc1`` for the second use ``fc1#2``."""
        return base_name(self.path)

    @property
    def kept(self) -> str:
        """Why the site runs as it is whatever the rules say, or ``""``."""
        if self.frozen:
            return f"inside {self.frozen}"
        if self.integer:
            return "integer operands"
        return self.unsupported

    @property
    def weights(self) -> frozenset[Weight]:
        """The parameters feeding the weight side (the rhs, else the lhs)."""
        return self.rhs or self.lhs

    @property
    def op(self) -> Any:
        """The site's op kind (its value in :data:`qbits.ops.KINDS`)."""
        return ops.KINDS[self.primitive]

    @property
    def kind(self) -> str:
        """``weight x activation``-style description of the operands."""
        sides = [
            "weight" if self.lhs else "activation",
            "weight" if self.rhs else "activation",
        ]
        name = "einsum" if self.label else self.op.short
        return f"{name} ({sides[0]} x {sides[1]})"


@dataclasses.dataclass
class Program:
    """A traced function, its matmul sites and how to call its jaxpr.

    Attributes:
      closed: The function's ClosedJaxpr (flat inputs: the dynamic leaves).
      sites: Every matmul, in program order.
      param_paths: Module paths of every parameter leaf (for rule reports).
      dynamic: Which leaves of ``(args, kwargs)`` are traced inputs.
      in_tree: The tree of ``(args, kwargs)``.
      out_tree: The tree of the output.
      statics: The non-array leaves, kept as given.
      escaped: The parameters that something other than a matmul operand
        reads (an embedding lookup, an addition, an output of the function).
    """

    closed: Any
    sites: list[Site]
    param_paths: tuple[str, ...]
    dynamic: tuple[bool, ...]
    in_tree: Any
    out_tree: Any
    statics: tuple[Any, ...]
    escaped: frozenset[Weight] = frozenset()


def _is_array(x: Any) -> bool:
    """Whether a leaf is traced (arrays and their specs) rather than static."""
    return isinstance(
        x, (jax.Array, jax.core.Tracer, np.ndarray, np.generic, jax.ShapeDtypeStruct)
    ) or hasattr(x, "__jax_array__")


def _shape(aval: Any) -> str:
    dtype = aval.dtype
    short = {"float32": "f32", "bfloat16": "bf16", "float16": "f16",
             "float64": "f64"}.get(str(dtype), str(dtype))  # fmt: skip
    return f"{short}[{','.join(str(d) for d in aval.shape)}]"


def _union(values: list[_Value]) -> _Value:
    origins: frozenset[tuple[str, ...]] = frozenset()
    for v in values:
        origins |= v.origins
    if len(origins) > _MAX_ORIGINS:
        origins = frozenset()
    return _Value(frozenset(), origins)


@dataclasses.dataclass(frozen=True)
class _Where:
    """Where the walk is: what an equation's enclosing bodies decide.

    The fields of :class:`Site` of the same names; ``stack`` is the name
    stack so far.
    """

    ctx: Ctx = ()
    frozen: str = ""
    stack: str = ""
    loops: tuple[int, ...] = ()
    control: str = ""
    mapped: bool = False

    def at(self, i: int, eqn: Any) -> _Where:
        """Equation ``i`` of this body."""
        stack = f"{self.stack}/{eqn.source_info.name_stack}".strip("/")
        return dataclasses.replace(self, ctx=(*self.ctx, i), stack=stack)


class _Walker:
    """Follows parameters through a jaxpr and records its matmul sites."""

    def __init__(self) -> None:
        self.sites: list[Site] = []
        # Inside a custom-gradient body, the weights its call was given: the
        # body quantizes them before multiplying, which hides their paths.
        self.region: frozenset[Weight] = frozenset()
        # Parameters read by anything but a matmul operand (or a move).
        self.escaped: set[Weight] = set()

    def lose(self, values: Sequence[_Value]) -> _Value:
        """The union of values whose parameters are read as activations."""
        for v in values:
            self.escaped.update(v.weights)
        return _union(list(values))

    def walk(self, jaxpr: Any, inputs: list[_Value], where: _Where) -> list[_Value]:
        env: dict[Any, _Value] = {}

        def read(v: Any) -> _Value:
            if isinstance(v, jcore.Literal):
                return _ACTIVATION
            return env.get(v, _ACTIVATION)

        for v, value in zip(jaxpr.invars, inputs, strict=True):
            env[v] = value
        for i, eqn in enumerate(jaxpr.eqns):
            ins = [read(v) for v in eqn.invars]
            outs = self._eqn(eqn, eqn.primitive.name, ins, where.at(i, eqn))
            for v, value in zip(eqn.outvars, outs, strict=True):
                env[v] = value
        return [read(v) for v in jaxpr.outvars]

    def _eqn(self, eqn: Any, name: str, ins: list[_Value], at: _Where) -> list[_Value]:
        n_out = len(eqn.outvars)
        kind = ops.KINDS.get(name)
        if kind is not None and kind.is_matmul(eqn.params):
            return [self._site(kind, eqn, ins, at)]
        if name in _MOVES and ins:
            return [ins[0]] + [_ACTIVATION] * (n_out - 1)
        if name in _PASS_EACH:
            return list(ins[:n_out])
        if name in _CALLS:
            return self.walk(eqn.params["jaxpr"].jaxpr, ins, at)
        if name in _REMATS:
            return self.walk(eqn.params["jaxpr"], ins, at)
        if name == "scan":
            return self._scan(eqn, ins, at)
        if name == "cond":
            for j, b in enumerate(eqn.params["branches"]):
                branch = dataclasses.replace(at, ctx=(*at.ctx, j), control="cond")
                self.walk(b.jaxpr, ins[1:], branch)
            return [self.lose(ins[1:])] * n_out
        if name == "while":
            p = eqn.params
            nc, nb = p["cond_nconsts"], p["body_nconsts"]
            self.lose(ins[:nc])
            carry = [self.lose([v]) for v in ins[nc + nb :]]
            body = dataclasses.replace(at, control="while")
            self.walk(p["body_jaxpr"].jaxpr, ins[nc : nc + nb] + carry, body)
            # The condition runs as it is (ctx -1: not a body of the runner).
            condition = dataclasses.replace(
                body, ctx=(*at.ctx, -1), frozen=at.frozen or "a while_loop condition"
            )
            self.walk(p["cond_jaxpr"].jaxpr, ins[:nc] + carry, condition)
            return [_union(ins[nc + nb :])] * n_out
        if name == "shard_map":  # each shard's operands: a weight's block
            body, _ = shard_map_body(eqn.params)
            inside = dataclasses.replace(at, mapped=True)
            return self.walk(body, ins, inside)
        subs = list(_sub_jaxprs(eqn.params))
        if name in _CUSTOM and subs and subs[0].outvars == subs[0].invars:
            return list(ins)  # an identity with a derivative rule of its own
        if subs:
            why = at.frozen or ("custom_vjp" if "vjp" in name else
                                "custom_jvp" if "jvp" in name else name)  # fmt: skip
            inside = dataclasses.replace(at, frozen=why)
            outer = self.region
            self.region = outer or frozenset().union(*(v.weights for v in ins))
            if name in _CUSTOM and len(subs[0].invars) == len(ins):
                self.walk(subs[0], ins, inside)
            else:
                for sub in subs:
                    self.walk(sub, [_ACTIVATION] * len(sub.invars), inside)
            self.region = outer
        return [self.lose(ins)] * n_out

    def _site(self, kind: Any, eqn: Any, ins: list[_Value], at: _Where) -> _Value:
        """Records a matmul site; its output's value (its weights' modules)."""
        lhs, rhs = ins[0], ins[1]
        if at.frozen and not (lhs.weights or rhs.weights) and self.region:
            rhs = _Value(self.region, rhs.origins)
        acts = not (lhs.weights or rhs.weights)
        scope = common(lhs.origins | rhs.origins) if acts else ()
        # Einsum subscripts and operand order: a plain dot_general's only.
        label = "" if kind.limited else einsum_label(at.stack)
        swapped = bool(label) and acts and flipped(label, eqn)
        avals = [v.aval for v in eqn.invars]
        site = Site(
            ctx=at.ctx,
            primitive=kind.name,
            operands=" x ".join(
                _shape(a) for a in (avals[1::-1] if swapped else avals[:2])
            ),
            lhs=lhs.weights,
            rhs=rhs.weights,
            label=label,
            scope=scope,
            frozen=at.frozen,
            loops=at.loops,
            control=at.control,
            mapped=at.mapped,
            contracting=kind.contracting(eqn.params),
            flipped=swapped,
            integer=all(_integer(a.dtype) for a in avals[:2]),
            unsupported=kind.unsupported(eqn.params, avals) or _unreal(eqn),
            eqn=eqn,
        )
        self.sites.append(site)
        weights = rhs.weights or lhs.weights
        if weights:
            return _Value(frozenset(), frozenset(w.path[:-1] for w in weights))
        # the root's scope too: a later matmul's scope is within it
        return _Value(frozenset(), frozenset((scope,)))

    def _scan(self, eqn: Any, ins: list[_Value], at: _Where) -> list[_Value]:
        p = eqn.params
        n_consts, n_carry = scan_counts(p)
        length = int(p["length"])
        carry = [self.lose([v]) for v in ins[n_consts : n_consts + n_carry]]
        xs = [
            _Value(
                frozenset(
                    dataclasses.replace(w, sliced=w.sliced | {at.ctx})
                    for w in v.weights
                ),
                v.origins,
            )
            for v in ins[n_consts + n_carry :]
        ]
        inputs = ins[:n_consts] + carry + xs
        body = dataclasses.replace(at, loops=(*at.loops, length))
        outs = self.walk(p["jaxpr"].jaxpr, inputs, body)
        return [self.lose([v]) for v in outs]


def _integer(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.bool_))


def float_operands(eqn: Any, operands: list[Any]) -> list[Any]:
    """A matmul equation's operands, an integer one times a float one made float.

    ``x_uint8 @ w`` reaches ``dot_general`` with its operands as they are
    (and a ``preferred_element_type``). Where one of the two operands is an
    integer and the other floating point, the integer one is converted to
    the equation's ``preferred_element_type`` where that is floating point,
    else to the other operand's dtype, so that quantizing the matmul is
    quantizing ``x.astype(w.dtype) @ w``; as in JAX, no gradient flows to
    it. Other operands are returned as they are.
    """
    dtypes = [v.aval.dtype for v in eqn.invars[:2]]
    ints = [_integer(d) for d in dtypes]
    if not (any(ints) and any(jnp.issubdtype(d, jnp.floating) for d in dtypes)):
        return operands
    pet = eqn.params.get("preferred_element_type")
    if pet is None or not jnp.issubdtype(pet, jnp.floating):
        pet = dtypes[1] if ints[0] else dtypes[0]
    pair = [
        jax.lax.convert_element_type(x, pet) if i else x
        for x, i in zip(operands[:2], ints, strict=True)
    ]
    return [*pair, *operands[2:]]


def _unreal(eqn: Any) -> str:
    """``"complex operands"`` for a matmul of complex numbers, else ``""``."""
    dtypes = [v.aval.dtype for v in eqn.invars[:2]]
    if any(jnp.issubdtype(d, jnp.complexfloating) for d in dtypes):
        return "complex operands"
    return ""


def _sub_jaxprs(params: dict[str, Any]) -> list[Any]:
    """The open jaxprs held by an equation's params."""
    found = []
    for value in params.values():
        items = value if isinstance(value, (tuple, list)) else (value,)
        for item in items:
            if isinstance(item, jcore.ClosedJaxpr):
                found.append(item.jaxpr)
            elif isinstance(item, jcore.Jaxpr):
                found.append(item)
    return found


def trace(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    params_argnum: int | None,
    owner: str = "qbits.quantize",
) -> Program:
    """Traces ``fn(*args, **kwargs)`` and finds its matmuls.

    Array leaves of the arguments are traced; other leaves (Python numbers,
    strings, flags) stay static, as in a direct call. Leaves of
    ``args[params_argnum]`` are the parameters that name the sites.

    Raises:
      InvalidArgumentError: When ``params_argnum`` names no positional
        argument.
    """
    if params_argnum is not None and not (
        isinstance(params_argnum, int) and 0 <= params_argnum < len(args)
    ):
        raise InvalidArgumentError(
            owner,
            "params_argnum",
            params_argnum,
            f"the index of the positional argument holding the parameters "
            f"(0..{len(args) - 1} for this call), or None",
        )
    leaves_with_path, in_tree = jax.tree_util.tree_flatten_with_path((args, kwargs))
    leaves = [leaf for _, leaf in leaves_with_path]
    dynamic = tuple(_is_array(x) for x in leaves)
    statics = tuple(x for x, d in zip(leaves, dynamic, strict=True) if not d)
    inputs: list[_Value] = []
    params: list[str] = []
    for (keypath, _), d in zip(leaves_with_path, dynamic, strict=True):
        if not d:
            continue
        is_param = (
            params_argnum is not None
            and len(keypath) >= 2
            and keypath[0] == jax.tree_util.SequenceKey(0)
            and keypath[1] == jax.tree_util.SequenceKey(params_argnum)
        )
        if is_param:
            path = param_path(keypath[2:])
            params.append("/".join(path[:-1]))
            inputs.append(_Value(frozenset((Weight(path, tuple(keypath[2:])),))))
        else:
            inputs.append(_ACTIVATION)

    def flat_fn(*dyn: Any) -> Any:
        a, k = jax.tree.unflatten(in_tree, merge(dynamic, dyn, statics))
        return fn(*a, **k)

    specs = [x for x, d in zip(leaves, dynamic, strict=True) if d]
    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*specs)
    walker = _Walker()
    walker.lose(walker.walk(closed.jaxpr, inputs, _Where()))
    program = Program(
        closed=closed,
        sites=walker.sites,
        param_paths=tuple(dict.fromkeys(params)),
        dynamic=dynamic,
        in_tree=in_tree,
        out_tree=jax.tree.structure(out_shape),
        statics=statics,
        escaped=frozenset(walker.escaped),
    )
    name_sites(program.sites)
    return program


def merge(dynamic: Sequence[bool], dyn: Sequence[Any], statics: Sequence[Any]) -> list:
    """The full leaf list from the traced and the static leaves."""
    it_dyn, it_static = iter(dyn), iter(statics)
    return [next(it_dyn) if d else next(it_static) for d in dynamic]
