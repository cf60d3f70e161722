"""Run with 8 CPU devices: a sharded (FSDP + tensor-parallel) quantized LM.

Invoked by test_sharded_lm.py in a subprocess (XLA_FLAGS must be set before
JAX starts). A small transformer-style LM (attention einsums, an MLP, a
head), its parameters sharded over a 4 x 2 mesh: the ``embed`` axis over
``data`` (FSDP), the ``mlp``/``heads``/``vocab`` axes over ``model``
(tensor parallel), the batch over ``data``. Checks, for linen with logical
axis rules and for nnx with sharding annotations, with the ``int8`` and
``fp8_delayed`` presets (linen) and ``int8`` (nnx), all through the one
engine (``qbits.quantize``): loss and gradients equal the unsharded ones within
float32 rounding; each gradient is sharded as float32's or within its
parameter's sharding (linen; the parameters' own under explicit axes). The same
for a plain-JAX block under explicit mesh axes (``out_sharding`` on every
einsum) through ``qbits.quantize``. An FSDP shard quantized with the
amax reduced over the shards gives the gathered weight's codes bit for bit.
Prints one JSON line with the collectives of each optimized training step
(``count_collectives``), what some of them carry (``collective_roles``) and
the all-gather bytes of an FSDP weight
(``gathered_weight_bytes``; benchmarks/sharded_collectives.py reuses
both). Exits non-zero on a mismatch.
"""

import functools
import json
import os
import re
import tempfile

# Keeps the runner's flags and adds the devices. Level 0 leaves LLVM's
# optimizations of the kernels out (a third of the CPU time here): the
# optimized HLO, its shardings and collectives, is the same.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + (
    " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
)

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import qbits
import qbits.hlo

# The example's logical axis -> mesh axis rules: FSDP over `data`, tensor
# parallel over `model`.
from examples.sharded_lm import RULES

WIDTH, HEADS, MLP, VOCAB, LAYERS = 32, 4, 64, 64, 1
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
               "collective-permute")  # fmt: skip


def _init(axes):
    return nn.with_logical_partitioning(nn.initializers.lecun_normal(), axes)


def _dense(features, axes, name):
    """A Dense layer whose kernel and bias are sharded by their logical axes."""
    bias = nn.with_logical_partitioning(nn.initializers.zeros_init(), axes[-1:])
    return nn.Dense(features, kernel_init=_init(axes), bias_init=bias, name=name)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(use_scale=False, use_bias=False)(x)
        qkv = nn.DenseGeneral(
            (3, HEADS, WIDTH // HEADS),
            kernel_init=_init(("embed", None, "heads", "kv")),
            use_bias=False,
            name="qkv",
        )(h)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        probs = jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q, k), axis=-1)
        ctx = jnp.einsum("bnts,bsnh->btnh", probs, v)
        x = x + nn.DenseGeneral(
            WIDTH,
            axis=(-2, -1),
            kernel_init=_init(("heads", "kv", "embed")),
            use_bias=False,
            name="out",
        )(ctx)
        h = nn.LayerNorm(use_scale=False, use_bias=False)(x)
        h = _dense(MLP, ("embed", "mlp"), "fc1")(h)
        h = _dense(WIDTH, ("mlp", "embed"), "fc2")(jax.nn.gelu(h))
        return x + h


class LM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(
            VOCAB, WIDTH, embedding_init=_init(("vocab", "embed")), name="embed"
        )(tokens)
        for i in range(LAYERS):
            x = Block(name=f"blocks_{i}")(x)
        return _dense(VOCAB, ("embed", "vocab"), "head")(x)


def _loss(logits, tokens):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, tokens[..., None], -1))


def _close(got, want, what, flips=False):
    """Equal within float32 rounding; with ``flips``, up to rounding flips.

    Sharding changes the order of the reductions around the matmuls (layer
    norms, softmax, the contraction's partial sums), which moves values by
    an ulp or so; a value sitting on a rounding boundary of the int8/fp8
    grid then rounds to the neighbouring code, and the gradients that see
    it move by one quantization step. Allowed: at most 3% of a tensor's
    elements beyond float32 rounding, none by more than 2% of its largest
    magnitude; the median element within float32 rounding.
    """
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = float(np.abs(b).max()) if b.size else 0.0
        tol = 2e-5 * np.abs(b) + 2e-5 * scale
        off = np.abs(a - b) > tol
        if not flips:
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5 * scale,
                                       err_msg=what)  # fmt: skip
            continue
        worst = float(np.abs(a - b).max()) if b.size else 0.0
        if (
            off.mean() > 0.03
            or worst > 0.02 * scale
            or (b.size and np.median(np.abs(a - b)) > 2e-5 * scale)
        ):
            raise AssertionError(
                f"{what}: {off.mean():.1%} of {b.shape} off, worst {worst:.3g} "
                f"(largest {scale:.3g})"
            )


_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1,
          "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1}  # fmt: skip
_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT )?%\S+ = (.+?) (" + "|".join(COLLECTIVES) + r")(-start)?\("
)
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


def count_collectives(hlo: str) -> dict[str, dict[str, int]]:
    """Per collective kind in optimized HLO text: ops and result bytes.

    A combined collective (XLA merges small all-reduces into one of a tuple)
    is one op, its bytes those of every array in it; an async ``-start``
    counts its result (the last array of its tuple) once, its ``-done`` not.
    """
    found: dict[str, dict[str, int]] = {}
    for line in hlo.splitlines():
        m = _COLLECTIVE.match(line)
        if not m:
            continue
        shapes = _SHAPE.findall(m.group(1))
        if m.group(3):
            shapes = shapes[-1:]
        nbytes = 0
        for dtype, dims in shapes:
            n = _BYTES.get(dtype, 4)
            for d in filter(None, dims.split(",")):
                n *= int(d)
            nbytes += n
        entry = found.setdefault(m.group(2), {"ops": 0, "bytes": 0})
        entry["ops"] += 1
        entry["bytes"] += nbytes
    return found


_DEF = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) ([\w-]+)\((.*?)\)(?:, |$)")


def collective_roles(hlo: str) -> dict[str, int]:
    """What some collectives of optimized HLO text carry, by what feeds them.

    ``scale all-gathers``: all-gathers of float32 arrays made inside qbits'
    core other than a matmul's operand (per-token or per-channel bounds and
    scales; codes and float activations are ``dot_general`` operands);
    ``of them, slices of a replicated value``: those whose gathered shard is
    computed from ``partition-id`` (XLA slices a value every device holds,
    maps it on the slice, and gathers it back). ``second-stage all-reduces``:
    all-reduces of another all-reduce's result (XLA reduces a tensor sharded
    over two mesh axes with one all-reduce per axis).
    """
    defs = {}
    for line in hlo.splitlines():
        m = _DEF.match(line)
        if m:
            args = [a.strip().lstrip("%") for a in m.group(4).split(",")]
            defs[m.group(1)] = (m.group(2), m.group(3), args, line)
    reduces = {n for n, d in defs.items() if d[1].startswith("all-reduce")}

    def of_reduce(arg):
        d = defs.get(arg)
        return arg in reduces or (
            d is not None and d[1] == "get-tuple-element" and d[2][0] in reduces
        )

    roles = dict.fromkeys(("scale all-gathers", "of them, slices of a replicated value",
                           "second-stage all-reduces"), 0)  # fmt: skip
    for name, (shape, op, args, line) in defs.items():
        meta = re.search(r'op_name="([^"]*)"', line)
        meta = meta.group(1) if meta else ""
        if op.startswith("all-gather") and shape.startswith("f32"):
            if "_core" in meta and not meta.endswith("dot_general"):
                roles["scale all-gathers"] += 1
                producer = defs.get(args[0])
                if producer and "partition-id" in producer[2]:
                    roles["of them, slices of a replicated value"] += 1
        elif name in reduces and any(of_reduce(a) for a in args):
            roles["second-stage all-reduces"] += 1
    return roles


def variant_of(model, variant, engine, key):
    """``(apply, init, rngs)`` of the LM for float32 or a preset."""
    if variant == "float32":
        return model.apply, model.init, {}
    if engine:
        return qbits.quantize(model.apply, variant, key), model.init, {}
    wrapped = qbits.flax.quantize(model, variant)  # state in the variables
    rngs = {"rngs": {"quant": key}} if variant == "int8" else {}
    return wrapped.apply, wrapped.init, rngs


def _step(apply, rngs):
    @jax.jit
    def step(variables, tokens):
        def loss(variables):
            return _loss(apply(variables, tokens, **rngs), tokens)

        return jax.value_and_grad(loss)(variables)

    return step


def _shardings(mesh, tokens, variables):
    abstract = jax.eval_shape(LM().init, jax.random.key(0), tokens)
    logical = nn.get_partition_spec(abstract)
    params = nn.logical_to_mesh_sharding(logical, mesh, RULES)["params"]
    return {
        name: params
        if name == "params"
        else jax.tree.map(lambda _: NamedSharding(mesh, P()), tree)
        for name, tree in variables.items()
    }


def compiled_text(fn, *args):
    """The optimized HLO of ``jax.jit(fn)(*args)`` (benchmarks/sharded_collectives.py
    swaps in a deviceless compile for GPUs)."""
    return jax.jit(fn).lower(*args).compile().as_text()


def collectives_of(mesh, tokens, variant, engine=False):
    """The collectives of the sharded training step (compiled, not run):
    ``(count_collectives, collective_roles)``."""
    key = jax.random.key(1)
    apply, init, rngs = variant_of(LM(), variant, engine, key)
    variables = nn.unbox(
        jax.eval_shape(init, {"params": jax.random.key(0), "quant": key}, tokens)
    )
    variables = jax.tree.map(
        lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
        variables,
        _shardings(mesh, tokens, variables),
    )
    batch = jax.ShapeDtypeStruct(
        tokens.shape, tokens.dtype, sharding=NamedSharding(mesh, P("data", None))
    )
    with jax.set_mesh(mesh):
        text = compiled_text(_step(apply, rngs), variables, batch)
    return count_collectives(text), collective_roles(text)


class _Fsdp(nn.Module):
    """One matmul whose weight is sharded over ``data`` (FSDP)."""

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.lecun_normal(), (256, 256))
        return x @ w


def gathered_weight_bytes(configs, devices=None):
    """All-gather bytes of one FSDP matmul's training step, per config.

    ``x @ w``, ``w`` 256 x 256 sharded over 8 devices along its contracted
    axis, ``x`` along the batch: the only all-gathers are the weight's
    (float32, or codes and scales).
    """
    mesh = jax.make_mesh((8,), ("data",), (AxisType.Auto,), devices=devices)
    x = jax.ShapeDtypeStruct(
        (64, 256), jnp.float32, sharding=NamedSharding(mesh, P("data"))
    )
    key = jax.random.key(1)
    out = {}
    for config in configs:
        apply, init, rngs = variant_of(_Fsdp(), config, False, key)
        variables = jax.eval_shape(init, {"params": key, "quant": key}, x)

        def placed(path, v):
            w = jax.tree_util.keystr(path) == "['params']['w']"
            sharding = NamedSharding(mesh, P("data") if w else P())
            return jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)

        variables = jax.tree_util.tree_map_with_path(placed, variables)

        def step(variables, x, apply=apply, rngs=rngs):
            return jax.grad(lambda v: jnp.sum(apply(v, x, **rngs) ** 2))(variables)

        found = count_collectives(compiled_text(step, variables, x))
        out[config] = found.get("all-gather", {}).get("bytes", 0)
    return out


def codes_case(mesh):
    """Quantizing an FSDP shard with the amax reduced over the shards gives
    the codes and scales of quantizing the gathered weight, bit for bit:
    per output channel (amax over the sharded contracted axis) and per
    tensor (the int8 and fp8 presets' weight quantizers)."""
    w = jax.random.normal(jax.random.key(6), (256, 64)) * 3
    for preset in ("int8", "fp8"):
        q = qbits.presets.get(preset).fwd.rhs

        @jax.jit
        def quant(w, q=q):
            t = q.quant(w, store=True, contracting_axes=(0,))
            return t.qvalue, t.scale

        whole = quant(w)
        shards = quant(jax.device_put(w, NamedSharding(mesh, P("data", "model"))))
        for a, b in zip(shards, whole, strict=True):
            if not np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32)):
                raise AssertionError(f"{preset}: sharded codes differ")


def linen_case(mesh, tokens, variant, reference=None):
    key = jax.random.key(1)
    apply, init, rngs = variant_of(LM(), variant, False, key)
    init_rngs = {"params": jax.random.key(0), "quant": key}
    variables = nn.unbox(jax.jit(init)(init_rngs, tokens))  # op by op, slower
    shardings = _shardings(mesh, tokens, variables)
    step = _step(apply, rngs)
    sharded = jax.device_put(variables, shardings)
    batch = jax.device_put(tokens, NamedSharding(mesh, P("data", None)))
    compiled = step.lower(sharded, batch).compile()
    got = compiled(sharded, batch)
    if variant != "float32":  # float32's sharded step is JAX's own
        want = step(variables, tokens)
        _close(got[0], want[0], f"linen {variant} loss")
        _close(got, want, f"linen {variant}", flips=True)
    # Each gradient is sharded as float32's (XLA picks them under auto axes)
    # or as its parameter, some axes replicated (each device holds its shard
    # of the parameter's gradient: the optimizer update needs no collective).
    found = jax.tree_util.tree_flatten_with_path(got[1]["params"])[0]
    grads = [g.sharding for _, g in found]
    params = jax.tree.leaves(shardings["params"])
    for (path, g), s, p in zip(found, reference or grads, params, strict=True):
        have, want = (
            tuple(x.spec) + (None,) * (g.ndim - len(x.spec)) for x in (g.sharding, p)
        )
        if not (
            g.sharding.is_equivalent_to(s, g.ndim)
            or all(h in (None, (), w) for h, w in zip(have, want, strict=True))
        ):
            where = jax.tree_util.keystr(path)
            raise AssertionError(
                f"linen {variant} {where} gradient: {g.sharding.spec}, "
                f"not float32's {s.spec} nor within {p.spec}"
            )
    text = compiled.as_text()
    return count_collectives(text), collective_roles(text), grads


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.fc1 = nnx.Linear(
            WIDTH, MLP, kernel_init=nnx.with_partitioning(init, ("data", "model")),
            rngs=rngs,
        )  # fmt: skip
        self.fc2 = nnx.Linear(
            MLP, WIDTH, kernel_init=nnx.with_partitioning(init, ("model", "data")),
            rngs=rngs,
        )  # fmt: skip

    def __call__(self, x):
        return x + self.fc2(jax.nn.gelu(self.fc1(x)))


class NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([NnxBlock(rngs) for _ in range(LAYERS)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def nnx_case(mesh, x, preset):
    def run(sharded: bool, preset=preset):
        model = NnxNet(nnx.Rngs(0))
        if preset is not None:
            model = qbits.nnx.quantize(model, preset, x, rngs=nnx.Rngs(quant=0))
        graphdef, state = nnx.split(model)
        if sharded:
            specs = nnx.get_partition_spec(state)
            state = jax.device_put(
                state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
            )
        params_filter = nnx.Param

        @jax.jit
        def step(state, x):
            model = nnx.merge(graphdef, state)
            wrt = nnx.DiffState(0, params_filter)
            loss, grads = nnx.value_and_grad(
                lambda m: jnp.mean(m(x) ** 2), argnums=wrt
            )(model)
            return loss, grads

        return step(state, x)

    want = run(False)
    got = run(True)
    _close(got[0], want[0], f"nnx {preset} loss")
    _close(got, want, f"nnx {preset}", flips=True)
    # Under auto axes XLA picks the gradients' shardings (float32's own
    # differ from the annotations too); they span the mesh.
    kernel = got[1]["blocks"][0]["fc1"]["kernel"][...]
    if len(kernel.sharding.device_set) != 8:
        raise AssertionError(f"nnx {preset}: fc1 gradient {kernel.sharding}")


def serving_case(mesh, tokens):
    """Stored int8 weights and scales keep their shardings: convert, serve,
    and an Orbax save/restore onto a mesh of another shape."""
    model = LM()
    abstract = jax.eval_shape(model.init, jax.random.key(0), tokens)
    logical = nn.get_partition_spec(abstract)
    shardings = nn.logical_to_mesh_sharding(logical, mesh, RULES)
    variables = jax.device_put(
        nn.unbox(jax.jit(model.init)(jax.random.key(0), tokens)), shardings
    )
    served = qbits.serving.convert(model, "int8_fwd", variables, tokens)
    stored = served.weights["blocks_0/fc1"]
    if stored["qvalue"].dtype != jnp.int8 or stored["qvalue"].sharding.spec != P(
        "data", "model"
    ):
        raise AssertionError(f"convert: {stored['qvalue'].sharding}")
    if stored["scale"].sharding.spec != P(None, "model"):
        raise AssertionError(f"convert scale: {stored['scale'].sharding}")
    server = qbits.serving.serve(model, "int8_fwd")
    out = jax.jit(server.apply)(served, tokens)
    other = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)

    def on_other(x):
        if not isinstance(x.sharding, NamedSharding):  # an empty placeholder
            return jax.ShapeDtypeStruct(x.shape, x.dtype)
        sharding = NamedSharding(other, x.sharding.spec)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    target = jax.tree.map(on_other, served)
    with tempfile.TemporaryDirectory() as tmp:
        qbits.serving.save(f"{tmp}/ckpt", served)
        restored = qbits.serving.restore(f"{tmp}/ckpt", target)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(served), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        if a.size == 0:  # an empty placeholder
            continue
        if a.sharding.mesh.shape != other.shape or a.sharding.spec != b.sharding.spec:
            raise AssertionError(f"restore: {a.sharding} (saved {b.sharding})")
    with jax.set_mesh(other):
        again = jax.jit(server.apply)(restored, tokens)
    np.testing.assert_allclose(np.asarray(again), np.asarray(out), rtol=1e-5,
                               atol=1e-5)  # fmt: skip


def _explicit_block(p, x, sharded):
    """A transformer block as plain JAX, FSDP + tensor parallel under
    explicit mesh axes: weights gathered along ``data`` before use
    (``reshard``), every einsum given its ``out_sharding``."""

    def out(spec):
        return spec if sharded else None

    def gather(w, spec):
        return jax.sharding.reshard(w, spec) if sharded else w

    heads = P("data", None, "model", None)
    proj = {n: gather(p[n], P(None, "model", None)) for n in ("wq", "wk", "wv")}
    q, k, v = (
        jnp.einsum("btd,dnh->btnh", x, proj[n], out_sharding=out(heads))
        for n in ("wq", "wk", "wv")
    )
    s = jnp.einsum("btnh,bsnh->bnts", q, k, out_sharding=out(P("data", "model")))
    c = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, -1), v,
                   out_sharding=out(heads))  # fmt: skip
    wo = gather(p["wo"], P("model", None, None))
    x = x + jnp.einsum("btnh,nhd->btd", c, wo, out_sharding=out(P("data")))
    w1, w2 = gather(p["w1"], P(None, "model")), gather(p["w2"], P("model", None))
    h = jnp.einsum("btd,df->btf", x, w1, out_sharding=out(P("data", None, "model")))
    return x + jnp.einsum(
        "btf,fd->btd", jax.nn.gelu(h), w2, out_sharding=out(P("data"))
    )


EXPLICIT_SPECS = {
    "wq": P("data", "model", None),
    "wk": P("data", "model", None),
    "wv": P("data", "model", None),
    "wo": P("model", None, "data"),
    "w1": P("data", "model"),
    "w2": P("model", "data"),
}


def explicit_case():
    """``qbits.quantize`` under explicit mesh axes (``AxisType.Explicit``):
    loss and gradients equal the unsharded ones, every gradient has its
    parameter's sharding (as the types say), and the weight dots are int8."""
    n, h = HEADS, WIDTH // HEADS
    shapes = {"wq": (WIDTH, n, h), "wk": (WIDTH, n, h), "wv": (WIDTH, n, h),
              "wo": (n, h, WIDTH), "w1": (WIDTH, MLP), "w2": (MLP, WIDTH)}  # fmt: skip

    @jax.jit  # one program, not one per shape
    def make():
        keys = jax.random.split(jax.random.key(4), len(shapes) + 1)
        params = {
            name: jax.random.normal(k, shape) / np.sqrt(shape[0])
            for k, (name, shape) in zip(keys, shapes.items(), strict=False)
        }
        return params, jax.random.normal(keys[-1], (8, 16, WIDTH))

    params, x = make()
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    preset = "int8"

    def loss(p, x, sharded):
        block = qbits.quantize(
            lambda p, x: _explicit_block(p, x, sharded), preset, jax.random.key(5)
        )
        return jnp.mean(block(p, x) ** 2)

    want = jax.jit(jax.value_and_grad(lambda p, x: loss(p, x, False)))(params, x)
    with jax.set_mesh(mesh):
        sharded = {n: jax.device_put(w, EXPLICIT_SPECS[n]) for n, w in params.items()}
        batch = jax.device_put(x, P("data"))
        step = jax.jit(jax.value_and_grad(lambda p, x: loss(p, x, True)))
        compiled = step.lower(sharded, batch).compile()  # once
        got = compiled(sharded, batch)
        dots = qbits.hlo.dot_dtypes(compiled.as_text())
    _close(got[0], want[0], f"explicit {preset} loss")
    # A rounding flip that changes a per-tensor amax moves every element
    # of that tensor's gradient a little (int8 quantizes the gradients
    # per tensor): here within 1% of the largest element.
    for name in params:
        a, b = np.asarray(got[1][name]), np.asarray(want[1][name])
        if np.abs(a - b).max() > 0.01 * np.abs(b).max():
            raise AssertionError(f"explicit {preset}: {name} gradient differs")
    for name, spec in EXPLICIT_SPECS.items():
        have = got[1][name].sharding.spec
        if have != spec:
            raise AssertionError(f"explicit {preset}: {name} grad {have} != {spec}")
    if ("s8", "s8", "s32") not in dots:
        raise AssertionError(f"explicit int8: dots {sorted(set(dots))}")
    # An amax over both mesh axes (per tensor) or `data` (per channel) is one
    # all-reduce (XLA's partitioner would take one per mesh axis): the
    # unsharded bound and gradient, bit for bit (a NaN block too).
    w = params["w1"].at[3, 5].set(jnp.nan)
    for axes in ((0, 1), (0,)):
        amax = functools.partial(qbits.AbsMax(), axes=axes)
        grad = jax.grad(lambda v, amax=amax: jnp.sum(amax(v)))
        both = jax.jit(lambda w, v, amax=amax, grad=grad: (amax(w), grad(v)))
        want = both(w, params["w1"])
        with jax.set_mesh(mesh):
            shards = jax.device_put(w, P("data", "model"))
            compiled = jax.jit(amax).lower(shards).compile()  # the bound alone
            got = (compiled(shards), both(shards, sharded["w1"])[1])
        reduces = count_collectives(compiled.as_text())["all-reduce"]["ops"]
        same = all(map(lambda a, b: np.array_equal(a, b, equal_nan=True), got, want))
        if reduces != 1 or not same:
            raise AssertionError(f"explicit amax over {axes}: {reduces}, {same}")


def main():
    assert jax.device_count() == 8, jax.devices()
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    tokens = jax.random.randint(jax.random.key(2), (8, 16), 0, VOCAB)
    counts, roles = {}, {}
    with jax.set_mesh(mesh):
        counts["float32"], roles["float32"], reference = linen_case(
            mesh, tokens, "float32"
        )
        for variant in os.environ.get("QBITS_VARIANTS", "int8,fp8_delayed").split(","):
            counts[variant], roles[variant], _ = linen_case(
                mesh, tokens, variant, reference
            )
        x = jax.random.normal(jax.random.key(3), (8, WIDTH))
        nnx_case(mesh, x, "int8")
        serving_case(mesh, tokens)
        codes_case(mesh)
    explicit_case()
    weights = gathered_weight_bytes(("float32", "int8"))
    print(json.dumps({"layers": LAYERS, "collectives": counts, "roles": roles,
                      "weights": weights}))  # fmt: skip


if __name__ == "__main__":
    main()
