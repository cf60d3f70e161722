"""What a sharded quantized training step sends: collectives and their bytes.

The sharded example LM of ``tests/transform/sharded_lm_check.py`` (width
32, 4 heads, MLP 64, vocabulary 64; batch 8 x 16 tokens) on 8 CPU devices,
a 4 x 2 mesh: FSDP (``embed`` over ``data``) plus tensor parallelism
(``mlp``/``heads``/``vocab`` over ``model``), the batch over ``data``. For
float32 and each preset, through the layer wrappers
(``qbits.flax.quantize``) and through the engine (``qbits.quantize`` of the
model's ``apply``), the optimized training step's collectives with 1 and 2
blocks: operations and result bytes per kind (a combined all-reduce of
several arrays is one operation, its bytes all of theirs). The second
block's minus the first's is what one block adds.

Separately, the bytes of the weights gathered: one FSDP matmul ``x @ w``
(``w`` 256 x 256 sharded over ``data`` along its contracted axis, ``x``
replicated), forward and both gradients, whose only all-gathers are the
weight's (codes and scales when quantized).

Under explicit mesh axes, the plain-JAX block of the same check (weights
gathered with ``reshard``, every einsum given its ``out_sharding``) through
``qbits.quantize``: its training step's collectives per kind.

With ``--target h200`` the same programs are compiled for 8 H200 GPUs
without a GPU (XLA's GPU compiler, deviceless; the CUDA plugin must be
installed: ``pip install 'qbits[gpu]'``), writing
``sharded_collectives_h200.{json,md}``: where the dot takes fp8 itself,
fp8 codes are gathered as fp8.

Run: python benchmarks/sharded_collectives.py [--target h200] [--json OUT.json]
[--md OUT.md] [--dump DIR] (``--dump`` writes each compiled program's optimized
HLO to DIR, numbered in compile order, to read what a collective carries; 8 host
devices are made before JAX starts; about two minutes on 2 cores, five for the
GPU.)
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + (
    " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
)

import argparse
import json
import pathlib

if "--target" in sys.argv:  # before JAX starts its backends
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu,cuda")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "transform"))

import sharded_lm_check as lm  # noqa: E402

import qbits  # noqa: E402
from qbits._platform import lowering_platforms  # noqa: E402

PRESETS = ("int8", "fp8", "fp8_delayed")
# Through the engine without state (fp8_delayed keeps its history in state:
# through the wrappers, which carry it).
ENGINE = ("int8", "fp8")
KINDS = ("all-gather", "collective-permute", "all-reduce", "all-to-all")
RESULTS = ROOT / "benchmarks" / "results"


def gpu_devices(name: str) -> list:
    """8 devices of the target GPU, for a deviceless compile; compiles
    for that GPU from here on."""
    from jax.experimental import topologies

    from qbits.hlo._targets import target

    config = target(name).config_text()
    topology = topologies.get_topology_desc(
        platform="cuda", target_config=config, topology="1x1x8"
    )
    options = dict(qbits.hlo.GPU_COMPILER_OPTIONS)

    def compiled_text(fn, *args):
        with lowering_platforms("cuda"):
            traced = jax.jit(fn).trace(*args)
        lowered = traced.lower(lowering_platforms=("cuda",))
        return lowered.compile(compiler_options=options).as_text()

    lm.compiled_text = compiled_text
    return list(topology.devices)


def dump_hlo(folder: pathlib.Path) -> None:
    """Writes every program compiled from here on to ``folder/NNN.hlo``."""
    folder.mkdir(parents=True, exist_ok=True)
    compile_text, count = lm.compiled_text, iter(range(10**6))

    def compiled_text(fn, *args):
        text = compile_text(fn, *args)
        (folder / f"{next(count):03d}.hlo").write_text(text)
        return text

    lm.compiled_text = compiled_text


def lm_counts(layers: int, devices: list | None) -> tuple[dict, dict]:
    """Collectives of the LM's training step, per config, and their roles."""
    lm.LAYERS = layers
    mesh = jax.make_mesh(
        (4, 2), ("data", "model"), (AxisType.Auto,) * 2, devices=devices
    )
    tokens = jax.random.randint(jax.random.key(2), (8, 16), 0, lm.VOCAB)
    counts, roles = {}, {}
    for preset in ("float32", *PRESETS):
        runs = [(preset, False)]
        if preset in ENGINE:
            runs.append((f"{preset} (qbits.quantize)", True))
        for name, engine in runs:
            counts[name], roles[name] = lm.collectives_of(
                mesh, tokens, preset, engine=engine
            )
    return counts, roles


def explicit_counts(devices: list | None) -> dict:
    """Collectives of the explicit-axes block's training step, per config:
    ops per kind, and its second-stage all-reduces."""
    n, h, width = lm.HEADS, lm.WIDTH // lm.HEADS, lm.WIDTH
    shapes = {"wq": (width, n, h), "wk": (width, n, h), "wv": (width, n, h),
              "wo": (n, h, width), "w1": (width, lm.MLP),
              "w2": (lm.MLP, width)}  # fmt: skip
    mesh = Mesh(
        np.asarray(devices or jax.devices()).reshape(4, 2),
        ("data", "model"),
        axis_types=(AxisType.Explicit,) * 2,
    )
    out = {}
    for config in ("float32", *ENGINE):

        def loss(p, x, config=config):
            block = lambda p, x: lm._explicit_block(p, x, True)  # noqa: E731
            if config != "float32":
                block = qbits.quantize(block, config, jax.random.key(5))
            return jnp.mean(block(p, x) ** 2)

        with jax.set_mesh(mesh):
            params = {
                k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=lm.EXPLICIT_SPECS[k])
                for k, s in shapes.items()
            }
            x = jax.ShapeDtypeStruct((8, 16, width), jnp.float32, sharding=P("data"))
            text = lm.compiled_text(jax.value_and_grad(loss), params, x)
        found = lm.count_collectives(text)
        out[config] = {k: v["ops"] for k, v in sorted(found.items())}
        second = lm.collective_roles(text)["second-stage all-reduces"]
        out[config]["second-stage all-reduces"] = second
    return out


def reduce_counts(devices: list | None) -> dict:
    """All-reduces of one absmax over every axis of a float32[8, 16, 64]
    tiled over the 4 x 2 mesh: plain ``jnp.max(jnp.abs(x))`` under auto axes
    (two dimensions tiled, or one over both mesh axes), and ``qbits.AbsMax``
    under explicit axes. Shows XLA's partitioner reducing a tensor tiled on
    two dimensions with one all-reduce per dimension."""
    out = {}
    cases = (
        ("auto axes, jnp.max, tiled (data, -, model)", AxisType.Auto,
         P("data", None, "model"), lambda x: jnp.max(jnp.abs(x))),
        ("auto axes, jnp.max, tiled (-, -, data x model)", AxisType.Auto,
         P(None, None, ("data", "model")), lambda x: jnp.max(jnp.abs(x))),
        ("explicit axes, qbits.AbsMax, tiled (data, -, model)", AxisType.Explicit,
         P("data", None, "model"), lambda x: qbits.AbsMax()(x, axes=(0, 1, 2))),
    )  # fmt: skip
    for name, kind, spec, fn in cases:
        mesh = Mesh(
            np.asarray(devices or jax.devices()).reshape(4, 2),
            ("data", "model"),
            axis_types=(kind,) * 2,
        )
        with jax.set_mesh(mesh):
            x = jax.ShapeDtypeStruct((8, 16, 64), jnp.float32, sharding=spec)
            found = lm.count_collectives(lm.compiled_text(fn, x))
        out[name] = found.get("all-reduce", {}).get("ops", 0)
    return out


def markdown(data: dict) -> str:
    """Per block (2 blocks minus 1) ops per kind, and the 2-block bytes."""
    one, two = data["blocks_1"], data["blocks_2"]

    def ops(counts: dict, kind: str) -> int:
        return counts.get(kind, {}).get("ops", 0)

    lines = [
        "| config | " + " | ".join(KINDS) + " | all | bytes (2 blocks) |",
        "|---" * (len(KINDS) + 3) + "|",
    ]
    for config, counts in two.items():
        per = [ops(counts, k) - ops(one[config], k) for k in KINDS]
        total = sum(v["bytes"] for v in counts.values())
        cells = " | ".join(map(str, [*per, sum(per)]))
        lines.append(f"| {config} | {cells} | {total / 1024:.0f} KiB |")
    r1, r2 = data["roles_1"], data["roles_2"]
    names = list(next(iter(r2.values())))
    lines += ["", "| config (per block) | " + " | ".join(names) + " |",
              "|---" * (len(names) + 1) + "|"]  # fmt: skip
    for config, roles in r2.items():
        per = [str(roles[n] - r1[config][n]) for n in names]
        lines.append(f"| {config} | {' | '.join(per)} |")
    lines += ["", "| config | gathered weight bytes | / float32 |", "|---|---|---|"]
    w = data["weights_gathered"]
    for config, n in w.items():
        lines.append(f"| {config} | {n} | {n / w['float32']:.2f} |")
    e = data["explicit_block"]
    names = sorted({k for c in e.values() for k in c})
    lines += ["", "| explicit axes, block | " + " | ".join(names) + " |",
              "|---" * (len(names) + 1) + "|"]  # fmt: skip
    for config, counts in e.items():
        lines.append(
            f"| {config} | " + " | ".join(str(counts.get(k, 0)) for k in names) + " |"
        )
    lines += ["", "| one absmax over all axes | all-reduces |", "|---|---|"]
    for name, n in data["absmax_reduce"].items():
        lines.append(f"| {name} | {n} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=("h200",), default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--md", default=None)
    parser.add_argument("--dump", default=None, help="write each optimized HLO here")
    args = parser.parse_args()
    out = RESULTS / f"sharded_collectives_{args.target or 'cpu'}"
    devices = gpu_devices(args.target) if args.target else None
    if args.dump:
        dump_hlo(pathlib.Path(args.dump))
    where = (
        f"8 {args.target} GPUs, compiled deviceless" if args.target else "8 CPU devices"
    )
    data = {
        "note": f"benchmarks/sharded_collectives.py on {where} (4x2 mesh, "
        f"auto axes), jax {jax.__version__}; collectives of the optimized "
        "training step with 1 and 2 blocks (ops and result bytes per kind; "
        "roles: what some carry, collective_roles); "
        "weights_gathered: all-gather bytes of one FSDP 256x256 matmul's step; "
        "explicit_block: ops per kind of the explicit-axes block's step; "
        "absmax_reduce: all-reduces of one absmax over a 2-axis-tiled array",
    }
    data["blocks_1"], data["roles_1"] = lm_counts(1, devices)
    data["blocks_2"], data["roles_2"] = lm_counts(2, devices)
    data["weights_gathered"] = lm.gathered_weight_bytes(("float32", *PRESETS), devices)
    data["explicit_block"] = explicit_counts(devices)
    data["absmax_reduce"] = reduce_counts(devices)
    pathlib.Path(args.json or out.with_suffix(".json")).write_text(
        json.dumps(data, indent=1) + "\n"
    )
    pathlib.Path(args.md or out.with_suffix(".md")).write_text(markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    main()
