"""Cold compile time at depth: an N-layer MLP training step, float32 vs qbits.

Every measurement runs in a fresh process (as a user meets it after a
restart): trace, lower and XLA-compile the first call of one SGD training
step of N Dense layers (width 256, batch 128, ReLU, MSE loss), on one core
with single-threaded XLA:CPU. Variants: float32, qbits ``int8`` (forward
and both backward matmuls, stochastic rounding of the gradients, the layers'
keys a chain of ``qbits.numerics.next_key``), ``int8_derive_key`` (the same
with each layer's key ``qbits.numerics._derive_key(key, i)``),
``int8_nearest`` (int8 everywhere, rounding to nearest), ``int8_reuse``
(the same, with the backward matmuls reusing the forward's quantized
operands: the work Qwix's QT does), ``int8_fwd``, ``fp8``,
``int8_quantize`` (the float loss quantized by ``qbits.quantize``),
``int8_linen`` and ``int8_nnx`` (the same layers as Flax ``Dense`` /
``nnx.Linear`` quantized by ``qbits.flax.quantize`` / ``qbits.nnx.quantize``,
the adapters over ``qbits.quantize``: one key per step, from linen's
``'quant'`` rng or nnx's stream, chained through the layers), and
Qwix's quantized training (QT) int8 when the ``qwix`` package is installed
(``pip install -e ".[compare]"``: a benchmark-only extra, never a
dependency of qbits). Also the 2-layer MLP of ``train_step.py``
(512 -> 2048 -> 512, batch 256).

Reports, per variant and depth, the median seconds over ``--repeats``
fresh processes (split into trace, lower and XLA compile), the ratio to
float32 at the same depth, and the per-layer slope (least squares over the
depths). Writes a JSON file and a markdown table (``--md``, also printed).

Run: python benchmarks/compile_depth.py --json OUT.json [--md OUT.md]
     [--depths 4 16 48] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

VARIANTS = (
    "float32",
    "int8",
    "int8_derive_key",
    "int8_nearest",
    "int8_reuse",
    "int8_fwd",
    "fp8",
    "int8_quantize",
    "int8_linen",
    "int8_nnx",
    "qwix_int8",
)
WIDTH, BATCH = 256, 128
MLP = (256, 512, 2048, 512)  # batch, in, hidden, out (train_step.py's MLP)


def _layers(model: str, depth: int) -> list[tuple[int, int]]:
    if model == "mlp":
        _, i, h, o = MLP
        return [(i, h), (h, o)]
    return [(WIDTH, WIDTH)] * depth


def child(variant: str, model: str, depth: int) -> dict[str, float]:
    """One cold compile in this (fresh) process: seconds per phase."""
    t0 = time.perf_counter()
    import jax
    import jax.numpy as jnp

    import_s = time.perf_counter() - t0
    dn = (((1,), (0,)), ((), ()))
    layers = _layers(model, depth)
    batch = MLP[0] if model == "mlp" else BATCH
    keys = jax.random.split(jax.random.key(0), len(layers) + 2)
    params = [
        jax.random.normal(k, shape) / shape[0] ** 0.5
        for k, shape in zip(keys, layers, strict=False)
    ]
    x = jax.random.normal(keys[-2], (batch, layers[0][0]))
    y = jax.random.normal(keys[-1], (batch, layers[-1][1]))
    key = jax.random.key(1)

    if variant == "qwix_int8":
        step = _qwix_step(params, x, y)
    elif variant in ("int8_linen", "int8_nnx"):
        flax_step = _linen_step if variant == "int8_linen" else _nnx_step
        step = flax_step(params, x, y, key)
    else:
        import qbits

        if variant in ("int8_nearest", "int8_reuse"):  # no stochastic rounding
            q = qbits.Quantizer(
                qbits.IntNumerics(bits=8), granularity=qbits.PerChannel()
            )
            mm = qbits.MatmulConfig(lhs=q, rhs=q)
            bwd = mm.replace(use_fwd_quant=variant == "int8_reuse")
            config = qbits.DotGeneralConfig(mm, bwd, bwd)
        elif variant == "int8_quantize":  # the float loss, transformed
            config = None
        else:
            preset = "int8" if variant == "int8_derive_key" else variant
            config = None if variant == "float32" else qbits.presets.get(preset)

        def layer_keys(key: jax.Array) -> list[jax.Array]:
            if variant == "int8_derive_key":  # a layer index in each key
                return [qbits.numerics._derive_key(key, i) for i in range(len(params))]
            keys = []  # a chain: the same kernel for every layer's key
            for _ in params:
                key = qbits.numerics.next_key(key)
                keys.append(key)
            return keys

        def dot(key: jax.Array | None):
            if config is None:
                return jax.lax.dot_general
            if not config.needs_key:
                return qbits.dot_general(config)
            return qbits.dot_general(config, key)

        def loss(params, x, y, key):
            h = x
            keys = layer_keys(key) if config is not None and config.needs_key else None
            for i, w in enumerate(params):
                h = dot(None if keys is None else keys[i])(h, w, dn)
                if i + 1 < len(params):
                    h = jax.nn.relu(h)
            return jnp.mean((h - y) ** 2)

        def step(params, x, y, key):
            if variant == "int8_quantize":
                grads = jax.grad(qbits.quantize(loss, "int8", key))(params, x, y, key)
                return _sgd(params, grads)
            return _sgd(params, jax.grad(loss)(params, x, y, key))

        step = jax.jit(step)
        args = (params, x, y, key)
    if variant in ("qwix_int8", "int8_linen", "int8_nnx"):
        step, args = step
    t1 = time.perf_counter()
    traced = step.trace(*args)
    t2 = time.perf_counter()
    lowered = traced.lower()
    t3 = time.perf_counter()
    compiled = lowered.compile()
    t4 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    return {
        "import_s": import_s,
        "trace_s": t2 - t1,
        "lower_s": t3 - t2,
        "compile_s": t4 - t3,
        "total_s": t4 - t1,
    }


def _sgd(params, grads):
    """One SGD step, the update every variant's step ends with."""
    import jax

    return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)


def _linen_net(params):
    """The stack of ``params`` as a linen model of bias-free Dense layers."""
    import flax.linen as nn

    sizes = [w.shape[1] for w in params]

    class Net(nn.Module):
        @nn.compact
        def __call__(self, h):
            for i, n in enumerate(sizes):
                h = nn.Dense(n, use_bias=False, name=f"fc{i}")(h)
                if i + 1 < len(sizes):
                    h = nn.relu(h)
            return h

    return Net()


def _qwix_step(params, x, y):
    """Qwix QT int8 (weights and activations, forward and backward)."""
    import jax
    import jax.numpy as jnp
    import qwix

    rules = [
        qwix.QtRule(
            module_path=".*",
            weight_qtype=jnp.int8,
            act_qtype=jnp.int8,
            bwd_qtype=jnp.int8,
        )
    ]
    model = qwix.quantize_model(_linen_net(params), qwix.QtProvider(rules))
    variables = model.init(jax.random.key(0), x)

    def loss(v, x, y):
        return jnp.mean((model.apply(v, x) - y) ** 2)

    def step(v, x, y):
        return _sgd(v, jax.grad(loss)(v, x, y))

    return jax.jit(step), (variables, x, y)


def _linen_step(params, x, y, key):
    """qbits.flax.quantize int8 on Dense layers; keys from the 'quant' stream."""
    import jax
    import jax.numpy as jnp

    import qbits
    import qbits.flax

    net = _linen_net(params)
    model = qbits.flax.quantize(net, "int8")
    variables = net.init(jax.random.key(0), x)

    def loss(v, x, y, key):
        return jnp.mean((model.apply(v, x, rngs={"quant": key}) - y) ** 2)

    def step(v, x, y, key):
        return _sgd(v, jax.grad(loss)(v, x, y, key))

    return jax.jit(step), (variables, x, y, key)


def _nnx_step(params, x, y, key):
    """qbits.nnx.quantize int8 on nnx.Linear layers; one key stream."""
    import flax.nnx as nnx
    import jax
    import jax.numpy as jnp

    import qbits
    import qbits.nnx

    shapes = [w.shape for w in params]

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List(
                [nnx.Linear(i, o, use_bias=False, rngs=rngs) for i, o in shapes]
            )

        def __call__(self, h):
            for i, layer in enumerate(self.layers):
                h = layer(h)
                if i + 1 < len(self.layers):
                    h = jax.nn.relu(h)
            return h

    model = qbits.nnx.quantize(Net(nnx.Rngs(0)), "int8", rngs=nnx.Rngs(quant=key))
    graph, params_state, rest = nnx.split(model, nnx.Param, ...)

    def step(params_state, rest, x, y):
        m = nnx.merge(graph, params_state, rest)
        grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(m)
        return _sgd(params_state, grads), nnx.state(m, nnx.Not(nnx.Param))

    return jax.jit(step), (params_state, rest, x, y)


def _has_qwix() -> bool:
    try:
        import qwix  # noqa: F401
    except ImportError:
        return False
    return True


def run_child(variant: str, model: str, depth: int) -> dict[str, float]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, __file__, "--child", variant, model, str(depth)]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", "0", *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode:
        raise RuntimeError(f"{variant} {model} {depth}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _slope(depths: list[int], seconds: list[float]) -> float | None:
    """Least-squares seconds per layer; ``None`` with fewer than two depths."""
    n = len(depths)
    mx, my = sum(depths) / n, sum(seconds) / n
    den = sum((d - mx) ** 2 for d in depths)
    if not den:
        return None
    return sum((d - mx) * (s - my) for d, s in zip(depths, seconds, strict=True)) / den


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--md")
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 16, 48])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    args = parser.parse_args()
    variants = [v for v in args.variants if v != "qwix_int8" or _has_qwix()]
    cases = [("deep", d) for d in args.depths] + [("mlp", 2)]
    raw: dict[str, dict[str, list[dict[str, float]]]] = {v: {} for v in variants}
    for r in range(args.repeats):  # interleaved: noise hits every variant alike
        for model, depth in cases:
            for v in variants:
                res = run_child(v, model, depth)
                raw[v].setdefault(f"{model}{depth}", []).append(res)
                print(f"[{r}] {v} {model} {depth}: {res['total_s']:.2f} s", flush=True)

    def median(v: str, case: str, key: str = "total_s") -> float:
        return statistics.median(m[key] for m in raw[v][case])

    results = {}
    for v in variants:
        entry = {}
        for model, depth in cases:
            case = f"{model}{depth}"
            entry[case] = {
                k: round(median(v, case, k), 4)
                for k in ("trace_s", "lower_s", "compile_s", "total_s")
            }
            entry[case]["ratio"] = round(median(v, case) / median("float32", case), 3)
        deep = [f"deep{d}" for d in args.depths]
        slope = _slope(args.depths, [median(v, c) for c in deep])
        entry["slope_s_per_layer"] = None if slope is None else round(slope, 4)
        results[v] = entry
    import jax

    meta = {
        "benchmark": "compile_depth",
        "model": f"N Dense layers {WIDTH} wide, batch {BATCH}, ReLU, SGD step; "
        "and the MLP 512->2048->512, batch 256",
        "repeats": args.repeats,
        "jax": jax.__version__,
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "single_threaded": True,
    }
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    head = " | ".join(f"{d} layers s (x f32)" for d in args.depths)
    lines = [
        f"Cold compile (fresh process, trace + lower + XLA compile), one core, "
        f"jax {jax.__version__}, median of {args.repeats}",
        "",
        f"| variant | {head} | s / layer | MLP 512-2048-512 (x f32) |",
        "|---|" + "---|" * (len(args.depths) + 2),
    ]
    for v, e in results.items():
        cells = [
            f"{e[f'deep{d}']['total_s']:.2f} ({e[f'deep{d}']['ratio']:.2f})"
            for d in args.depths
        ]
        mlp = e["mlp2"]
        slope = e["slope_s_per_layer"]
        lines.append(
            f"| {v} | {' | '.join(cells)} | "
            f"{'—' if slope is None else f'{slope:.3f}'} | "
            f"{mlp['total_s']:.2f} ({mlp['ratio']:.2f}) |"
        )
    table = "\n".join(lines) + "\n"
    print(table)
    if args.md:
        with open(args.md, "w") as f:
            f.write(table)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3], int(sys.argv[4]))))
    else:
        main()
