"""Run with 8 CPU devices: every leaf qbits makes has its parameter's sharding.

Invoked by test_explicit_mesh.py in a subprocess (XLA_FLAGS must be set
before JAX starts). Under explicit mesh axes (``AxisType.Explicit``, a
4 x 2 ``("data", "model")`` mesh set with ``jax.set_mesh``), with the
parameters sharded along their output channels: the scale state of
functions (``qbits.init_state``), linen (``qbits.flax.quantize``) and nnx
(``qbits.nnx.quantize``) models, with scanned layers and a ``shard_map``
inside; the codes and scales ``qbits.serving.convert`` stores; the LoRA
adapters ``qbits.lora.apply`` makes. Each leaf is checked against the spec
its parameter implies: a per-channel scale (and its amax history's channel
axis) sharded like the parameter's kept axis, per-tensor scales and
histories replicated, codes like their parameter, a LoRA ``A`` like the
parameter's input axis and ``B`` like its output axis. Then Orbax: saved
on the 4 x 2 mesh, restored onto a 2 x 4 one with the target's shardings.
Exits non-zero on a mismatch; prints ``ok`` and the leaves checked.
"""

import os
import tempfile

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
import qbits.lora
import qbits.ptq

D, F, LAYERS = 16, 32, 2
EXPLICIT = (AxisType.Explicit,) * 2
CHECKED = [0]


def _config() -> qbits.DotGeneralConfig:
    """Delayed scaling: the activation and the output gradient per tensor,
    the weight per output channel (a scale and a history per channel)."""
    history = qbits.DelayedScaling(history_length=4)
    tensor = qbits.Quantizer(qbits.IntNumerics(bits=8), provider=history)
    channel = qbits.Quantizer(
        qbits.IntNumerics(bits=8), granularity=qbits.PerChannel(), provider=history
    )
    return qbits.DotGeneralConfig(
        fwd=qbits.MatmulConfig(lhs=tensor, rhs=channel),
        dlhs=qbits.MatmulConfig(lhs=tensor),
    )


CONFIG = _config()


def _spec(x) -> tuple:
    """The mesh axes of each axis of ``x``, as its type (or array) says."""
    s = jax.typeof(x).sharding if isinstance(x, jax.core.Tracer) else x.sharding
    if not isinstance(s, NamedSharding):
        raise AssertionError(f"{x.shape} is not on the mesh: {s}")
    spec = tuple(None if e == () else e for e in s.spec)
    return spec + (None,) * (x.ndim - len(spec))


def _expect(what: str, x, spec: tuple, mesh=None) -> None:
    want = tuple(spec) + (None,) * (x.ndim - len(spec))
    if _spec(x) != want:
        raise AssertionError(f"{what}: {jax.typeof(x).sharding.spec} != P{want}")
    if mesh is not None and x.sharding.mesh.shape != mesh.shape:
        raise AssertionError(f"{what}: on {x.sharding.mesh.shape}, not {mesh.shape}")
    CHECKED[0] += 1


def check_state(what: str, state: dict, params: dict, stacked: bool = False) -> None:
    """Each matmul's state against its parameter ``params[path]``: the
    weight's (rhs) scale and history sharded as the parameter's output
    axis, the activation's and the gradient's (per tensor) replicated."""
    lead = (None,) if stacked else ()
    assert set(state) == set(params), (what, sorted(state), sorted(params))
    for path, entries in state.items():
        kept = _spec(params[path])[-1]
        names = {f"{t}_{n}" for t in ("lhs", "rhs", "grad")
                 for n in ("scale", "amax_history")}  # fmt: skip
        assert set(entries) == names, entries
        for name, x in entries.items():
            want = ()
            if name == "rhs_scale":
                want = (*lead, kept)
            elif name == "rhs_amax_history":
                want = (*lead, None, kept)
            _expect(f"{what} {path}/{name}", x, want)


def _weights(mesh_specs: dict) -> dict:
    """Random weights (drawn on the host), sharded as ``mesh_specs`` says."""
    rng = np.random.default_rng(0)
    out = {}
    for name, (shape, spec) in mesh_specs.items():
        w = rng.standard_normal(shape, np.float32) / np.sqrt(shape[-2])
        out[name] = jax.device_put(w, spec)
    return out


# Functions: an MLP (qbits.quantize / qbits.init_state), a scanned stack of
# layers, and a shard_map over the batch inside: one matmul there quantized
# by explicit injection (the engine carries no per-channel scale state into a
# shard_map body): its state made outside, from the global operands; the next one by
# the engine, stateless.
FN_SPECS = {
    "w1": ((D, F), P(None, "model")),
    "layers": ((LAYERS, F, F), P(None, None, "model")),
    "local": ((F, D), P(None, "model")),
    "inside": ((D, D), P(None, "model")),
}
RULES = qbits.QuantConfig(rules=(qbits.Rule("inside", "int8_fwd"),), default=CONFIG)
LOCAL = qbits.dot_general(CONFIG)
DIMS = (((1,), (0,)), ((), ()))


def mlp(p, x):
    h = jax.nn.relu(x @ p["w1"])  # P("data", "model")

    def layer(h, w):
        return jnp.tanh(h @ w), None

    return jax.lax.scan(layer, h, p["layers"])[0]


def fn(p, x, local_state):
    h = mlp(p, x)

    @jax.shard_map(in_specs=(P("data"), P(), P(), P()), out_specs=P("data"),
                   axis_names={"data"})  # fmt: skip
    def local(h, w, state, inside):  # per batch shard; "model" explicit inside
        return jnp.tanh(LOCAL(h, w, DIMS, state=state)) @ inside

    return local(h, p["local"], local_state, p["inside"])


def function_case(mesh):
    params = _weights(FN_SPECS)
    x = jax.device_put(np.random.default_rng(1).standard_normal((8, D), np.float32),
                       P("data"))  # fmt: skip
    h = jax.ShapeDtypeStruct((8, F), jnp.float32, sharding=P("data"))
    local = LOCAL.init_state(h, params["local"], DIMS)
    row = qbits.layer_table(fn, RULES, params, x, local)["inside"]
    assert (row.describe(), row.kind[-12:]) == ("int8_fwd", "in shard_map"), row
    # Traced (as in a jitted init); linen's and nnx's below: eager and jitted.
    state = jax.jit(lambda *a: qbits.init_state(fn, RULES, *a))(params, x, local)
    flat = {"w1": params["w1"]}
    check_state("qbits.init_state", {k: state[k] for k in flat}, flat)
    check_state("qbits.init_state (scan)", {"layers": state["layers"]},
                {"layers": params["layers"]}, stacked=True)  # fmt: skip
    check_state("dot_general.init_state (shard_map)", {"local": local},
                {"local": params["local"]})  # fmt: skip

    # The new state of a training step (the gradient of the state) keeps
    # the sharding; so do the parameters' gradients.
    @jax.jit
    def step(state, p, local):
        def loss(state, p, local):
            out = qbits.quantize(fn, RULES, state=state)(p, x, local)
            return jnp.mean(out**2)

        return jax.grad(loss, argnums=(0, 1, 2))(state, p, local)

    new, grads, new_local = step(state, params, local)
    check_state("new state", {k: new[k] for k in flat}, flat)
    check_state("new state (scan)", {"layers": new["layers"]},
                {"layers": params["layers"]}, stacked=True)  # fmt: skip
    check_state("new state (shard_map)", {"local": new_local},
                {"local": params["local"]})  # fmt: skip
    for name, g in grads.items():
        _expect(f"gradient {name}", g, _spec(params[name]))
    return params, x, state


def _sharded_init(key, shape, dtype=jnp.float32):
    """Linen under explicit axes: the kernel made sharded along its outputs."""
    w = nn.initializers.lecun_normal()(key, shape, dtype)
    return jax.sharding.reshard(w, P(*(None,) * (len(shape) - 1), "model"))


class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        dense = nn.Dense(F, use_bias=False, kernel_init=_sharded_init)
        return jnp.tanh(dense(h)), None


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(F, use_bias=False, kernel_init=_sharded_init, name="fc1")(x)
        scan = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                       length=LAYERS)  # fmt: skip
        return scan(name="blocks")(h, None)[0]


def linen_case(mesh, x):
    qmodel = qbits.flax.quantize(Mlp(), CONFIG)
    variables = jax.jit(qmodel.init)(jax.random.key(0), x)
    params = variables["params"]
    kernels = {"fc1": params["fc1"]["kernel"]}
    state = variables[qbits.flax.STATE]
    check_state("linen", {k: state[k] for k in kernels}, kernels)
    stacked = {"blocks/Dense_0": params["blocks"]["Dense_0"]["kernel"]}
    check_state("linen (scan)", {k: state[k] for k in stacked}, stacked, stacked=True)
    return qmodel, variables


class NnxMlp(nnx.Module):
    def __init__(self, rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
        self.fc1 = nnx.Linear(D, F, use_bias=False, kernel_init=init, rngs=rngs)

    def __call__(self, x):
        return jax.nn.relu(self.fc1(x))


def nnx_case(mesh, x):
    model = qbits.nnx.quantize(NnxMlp(nnx.Rngs(0)), CONFIG, x)
    state = nnx.to_pure_dict(nnx.state(model, qbits.nnx.ScaleState))
    kernels = {"fc1": model.fc1.kernel[...]}
    found = {}
    for keys, v in jax.tree_util.tree_leaves_with_path(state):
        *_, path, name = (k.key for k in keys)
        found.setdefault(path, {})[name] = v
    check_state("nnx", found, kernels)
    # Served: codes and scales as the kernel; the output laid out as the
    # float model's (the program is traced with the dropped kernel's zeros).
    float_model = NnxMlp(nnx.Rngs(0))
    served = qbits.serving.convert(float_model, "int8_fwd", x)
    spec = _spec(kernels["fc1"])
    _expect("nnx stored codes", served.qbits.stored["fc1"]["qvalue"][...], spec)
    _expect("nnx stored scale", served.qbits.stored["fc1"]["scale"][...], spec)
    _expect("nnx served output", served(x), _spec(float_model(x)))
    return model


def serving_case(mesh, other, params, x):
    """Stored codes and scales as their parameters, also restored with Orbax
    onto ``other`` (``qbits.serving.restore`` reads the target's shardings)."""
    weights = {k: params[k] for k in ("w1", "layers")}
    served = qbits.serving.convert(mlp, "int8_fwd", weights, x)
    for path, w in weights.items():
        stored, spec = served.weights[path], _spec(w)
        _expect(f"stored {path} codes", stored["qvalue"], spec)
        _expect(f"stored {path} scale", stored["scale"], (*spec[:-2], None, spec[-1]))

    # Post-training quantization's own codes and scales (its PtqResult),
    # and what serving stores from them.
    ptq = qbits.ptq.quantize_weights(mlp, weights, [x], "int8_fwd", method="rtn")
    from_ptq = qbits.serving.convert(mlp, "int8_fwd", ptq, x)
    for path, w in weights.items():
        spec = _spec(w)
        for what, qv, scale in (
            ("PtqResult", ptq.stored[path].qvalue, ptq.stored[path].scale),
            (
                "stored from PtqResult",
                *map(from_ptq.weights[path].get, ("qvalue", "scale")),
            ),
        ):
            _expect(f"{what} {path} codes", qv, spec)
            _expect(f"{what} {path} scale", scale, (*spec[:-2], None, spec[-1]))

    def on_other(x):
        if x.size == 0:  # a dropped parameter's placeholder
            return jax.ShapeDtypeStruct(x.shape, x.dtype)
        return jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(other, x.sharding.spec)
        )

    with tempfile.TemporaryDirectory() as tmp:
        qbits.serving.save(f"{tmp}/served", served)
        target = jax.tree.map(on_other, served)
        restored = qbits.serving.restore(f"{tmp}/served", target)
    _same(restored, served, other, "restored serving")
    return served


def _same(got, want, mesh, what):
    """Equal values; each array's sharding the saved one's, on ``mesh``."""
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=what)
        if a.size:
            _expect(what, a, _spec(b), mesh)


def lora_case(mesh, other, params, x):
    """LoRA's ``A`` as its weight's input axis, ``B`` as its output axis;
    QLoRA's NF4 base (codes packed, looked up in the codebook) as the
    weight; adapters restored onto ``other``; the adapted model runs, its
    output laid out as the float model's."""
    weights = {k: params[k] for k in ("w1", "layers")}
    nf4 = qbits.Quantizer(qbits.numerics.Nf4Numerics(), granularity=qbits.PerChannel())
    base_config = qbits.DotGeneralConfig(fwd=qbits.MatmulConfig(rhs=nf4))
    config = qbits.lora.LoraConfig(rank=4, base=base_config)
    lora_fn, base, adapters = qbits.lora.apply(mlp, config, weights, x,
                                               key=jax.random.key(1))  # fmt: skip
    for path, w in weights.items():
        spec = _spec(w)
        lead, (k, n) = spec[:-2], spec[-2:]
        _expect(f"LoRA {path} A", adapters[path]["a"], (*lead, k, None))
        _expect(f"LoRA {path} B", adapters[path]["b"], (*lead, None, n))
        _expect(f"QLoRA base {path} codes", base.weights[path].qvalue, spec)
        _expect(f"QLoRA base {path} scale", base.weights[path].scale,
                (*lead, None, n))  # fmt: skip

    def loss(a):
        out = lora_fn(a, base, x)
        _expect("QLoRA output", out, _spec(mlp(weights, x)))  # its type
        return jnp.sum(out**2)

    grads = jax.jit(jax.grad(loss))(adapters)
    for path, ab in grads.items():
        for name, g in ab.items():
            _expect(f"LoRA {path} {name} gradient", g, _spec(adapters[path][name]))
    target = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=NamedSharding(other, a.sharding.spec)
        ),
        adapters,
    )
    with tempfile.TemporaryDirectory() as tmp:
        qbits.lora.save_adapters(f"{tmp}/lora", adapters, config)
        restored = qbits.lora.restore_adapters(f"{tmp}/lora", target, config)
    _same(restored, adapters, other, "restored adapters")


def state_restore_case(other, state):
    """Scale state (a training checkpoint's) restored onto ``other``."""
    import orbax.checkpoint as ocp

    target = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=NamedSharding(other, a.sharding.spec)
        ),
        state,
    )
    with tempfile.TemporaryDirectory() as tmp, ocp.StandardCheckpointer() as ckpt:
        ckpt.save(f"{tmp}/state", state)
        ckpt.wait_until_finished()
        restored = ckpt.restore(f"{tmp}/state", target)
    _same(restored, state, other, "restored state")


def main():
    assert jax.device_count() == 8, jax.devices()
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=EXPLICIT)
    other = jax.make_mesh((2, 4), ("data", "model"), axis_types=EXPLICIT)
    with jax.set_mesh(mesh):
        params, x, state = function_case(mesh)
        linen_case(mesh, x)
        nnx_case(mesh, x)
        serving_case(mesh, other, params, x)
        lora_case(mesh, other, params, x)
        state_restore_case(other, state)
    print(f"ok: {CHECKED[0]} leaves")


if __name__ == "__main__":
    main()
