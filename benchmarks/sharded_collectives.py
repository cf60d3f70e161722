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

Run: python benchmarks/sharded_collectives.py [--json OUT.json] [--md OUT.md]
(8 host devices are made before JAX starts; about a minute on 2 cores.)
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

import jax
from jax.sharding import AxisType

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "transform"))

import sharded_lm_check as lm  # noqa: E402

PRESETS = ("int8", "fp8", "fp8_delayed")
# Through the engine without state (fp8_delayed keeps its history in state:
# through the wrappers, which carry it).
ENGINE = ("int8", "fp8")
KINDS = ("all-gather", "collective-permute", "all-reduce", "all-to-all")
OUT = ROOT / "benchmarks" / "results" / "sharded_collectives_cpu"


def lm_counts(layers: int) -> tuple[dict, dict]:
    """Collectives of the LM's training step, per config, and their roles."""
    lm.LAYERS = layers
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    tokens = jax.random.randint(jax.random.key(2), (8, 16), 0, lm.VOCAB)
    counts, roles = {}, {}
    with jax.set_mesh(mesh):
        for preset in ("float32", *PRESETS):
            runs = [(preset, False)]
            if preset in ENGINE:
                runs.append((f"{preset} (qbits.quantize)", True))
            for name, engine in runs:
                counts[name], roles[name] = lm.collectives_of(
                    mesh, tokens, preset, engine=engine
                )
    return counts, roles


def markdown(data: dict) -> str:
    """Per block (2 blocks minus 1) ops per kind, and the 2-block bytes."""
    one, two = data["blocks_1"], data["blocks_2"]

    def ops(counts: dict, kind: str) -> int:
        return counts.get(kind, {}).get("ops", 0)

    lines = [
        "| config | " + " | ".join(KINDS) + " | bytes (2 blocks) |",
        "|---" * (len(KINDS) + 2) + "|",
    ]
    for config, counts in two.items():
        per = [str(ops(counts, k) - ops(one[config], k)) for k in KINDS]
        total = sum(v["bytes"] for v in counts.values())
        lines.append(f"| {config} | {' | '.join(per)} | {total / 1024:.0f} KiB |")
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
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=str(OUT.with_suffix(".json")))
    parser.add_argument("--md", default=str(OUT.with_suffix(".md")))
    args = parser.parse_args()
    data = {
        "note": "benchmarks/sharded_collectives.py on 8 CPU devices (4x2 mesh, "
        f"auto axes), jax {jax.__version__}; collectives of the optimized "
        "training step with 1 and 2 blocks (ops and result bytes per kind; "
        "roles: what some carry, collective_roles); "
        "weights_gathered: all-gather bytes of one FSDP 256x256 matmul's step",
    }
    data["blocks_1"], data["roles_1"] = lm_counts(1)
    data["blocks_2"], data["roles_2"] = lm_counts(2)
    data["weights_gathered"] = lm.gathered_weight_bytes(("float32", *PRESETS))
    pathlib.Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    pathlib.Path(args.md).write_text(markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    main()
