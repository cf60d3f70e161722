"""Which matmuls of a model run quantized: layer wrappers vs qbits.quantize.

For model code written in the styles of ``examples/custom_models.py``
(custom layer classes with their own parameters and raw ``jnp.einsum``,
``@`` with several parameters of one module, a block-diagonal linear,
attention written with einsums, a tied embedding head, scanned and
rematerialised blocks; linen and nnx) and, for reference, a model built
only from Flax's own layers, counts the matmuls (``dot_general`` and
convolution equations) of the forward pass and of the gradient with
respect to the parameters, and how many of them take int8 operands with
the ``int8`` preset:

- **wrappers**: ``qbits.flax.quantize`` / ``qbits.nnx.quantize``, the
  linen and nnx adapters (since "One engine", thin adapters over the
  transformation: the two columns must agree on every model);
- **qbits.quantize**: the function transformation, which finds every
  matmul in the traced program.

And how many weight matmuls (a parameter times an activation) get their
weight stored by ``qbits.serving.convert`` with ``int8_fwd`` (linen: the
model; nnx: the module, and its function from ``qbits.nnx.as_function``).

Run: python benchmarks/coverage.py --json OUT.json [--md OUT.md]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import qbits
import qbits.hlo

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from examples.custom_models import LM, NnxMlp, lm_batch

KEY = jax.random.key(0)


class FlaxLayers(nn.Module):
    """Only Flax's own layers: what the wrappers were written for."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(32, 16)(tokens)
        x = x + nn.MultiHeadDotProductAttention(num_heads=2)(x)
        x = x + nn.Dense(16)(nn.relu(nn.Dense(32)(x)))
        return nn.Dense(32)(x)


class OwnFloatDot(nn.Module):
    """Layers given the model's own float ``dot_general`` (kept by wrappers)."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(32, 16)(tokens)
        x = nn.Dense(32, dot_general=jax.lax.dot_general)(x)
        return nn.Dense(32, dot_general=jax.lax.dot_general)(jax.nn.relu(x))


def _count(fn, *args) -> tuple[int, int]:
    """(int8 matmuls, all matmuls) in ``fn``'s jaxpr."""
    found = []
    for prim in ("dot_general", "conv_general_dilated"):
        found += qbits.hlo.dot_dtypes(fn, *args, primitive=prim, stage="jaxpr")
    return sum(a == "int8" for a, _, _ in found), len(found)


def _linen(name: str, model: nn.Module) -> dict:
    tokens = lm_batch()
    variables = model.init(KEY, tokens)
    params = variables["params"]
    wrapped = qbits.flax.quantize(model, "int8")
    transformed = qbits.quantize(model.apply, "int8", KEY)

    def via_wrapper(p, _):
        return wrapped.apply({"params": p}, tokens, rngs={"quant": KEY})

    def via_transform(p, _):
        return transformed({"params": p}, tokens)

    row = _row(name, "linen", via_wrapper, via_transform, (params, None))
    with warnings.catch_warnings():  # a model with nothing to store says so
        warnings.simplefilter("ignore")
        stored = qbits.serving.convert(model, "int8_fwd", variables, tokens)
    row["stored"] = (
        f"{len(stored.layers)} of {_weights(model.apply, variables, tokens)}"
    )
    return row


def _weights(fn, *args) -> int:
    """How many weight matmuls ``fn`` runs (layer-table rows with a weight)."""
    table = qbits.layer_table(fn, "int8_fwd", *args)
    return sum("weight" in row.kind for row in table.rows)


def _nnx(name: str, model: nnx.Module, x: jax.Array) -> dict:
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    wrapped = qbits.nnx.quantize(model, "int8", rngs=nnx.Rngs(quant=0))

    def forward(p, rest, x):
        return nnx.merge(graphdef, p, rest)(x)

    transformed = qbits.quantize(forward, "int8", KEY)

    def via_transform(p, rest):
        return transformed(p, rest, x)

    row = _row(name, "nnx", None, via_transform, (params, rest))

    def loss(m):
        return jnp.sum(m(x) ** 2)

    # The wrappers keep their key streams in the module: nnx.jit carries them.
    fwd = _count(nnx.jit(lambda m: m(x)), wrapped)
    grad_all = _count(nnx.jit(nnx.grad(loss)), wrapped)
    row["wrappers_fwd"] = fwd
    row["wrappers_bwd"] = (grad_all[0] - fwd[0], grad_all[1] - fwd[1])
    whole, state = nnx.split(model)
    pure = nnx.to_pure_dict(state)

    def apply(p, x):
        return nnx.merge(whole, p)(x)

    total = _weights(apply, pure, x)
    fn, state = qbits.nnx.as_function(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        served = qbits.serving.convert(model, "int8_fwd", x)
        module = qbits.serving.size_report(served)
        function = qbits.serving.convert(fn, "int8_fwd", state, x)
    row["stored"] = (
        f"module {len(module.layers)} of {total}; "
        f"function {len(function.layers)} of {total}"
    )
    return row


def _row(name, api, via_wrapper, via_transform, args, wargs=None) -> dict:
    wargs = args if wargs is None else wargs

    def loss(f):
        return lambda p, rest: jnp.sum(f(p, rest).astype(jnp.float32) ** 2)

    row = {"model": name, "api": api}
    for label, f, a in (
        ("wrappers", via_wrapper, wargs),
        ("transform", via_transform, args),
    ):
        if f is None:
            continue
        row[f"{label}_fwd"] = _count(f, *a)
        grad_all = _count(jax.grad(loss(f)), *a)
        fwd = row[f"{label}_fwd"]
        row[f"{label}_bwd"] = (grad_all[0] - fwd[0], grad_all[1] - fwd[1])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--md")
    args = parser.parse_args()
    rows = [
        _linen("custom Einsum modules, raw @, attention einsums, tied head",
               LM(depth=2)),
        _linen("the same, blocks scanned and rematerialised",
               LM(depth=2, scan=True, remat=True)),
        _linen("layers given the model's own float dot_general", OwnFloatDot()),
        _linen("Flax layers only (Dense, MultiHeadDotProductAttention)",
               FlaxLayers()),
        _nnx("raw @ with an nnx.Param, and an nnx.Linear", NnxMlp(nnx.Rngs(0)),
             jnp.ones((8, 16))),
    ]  # fmt: skip
    result = {"jax": jax.__version__, "preset": "int8", "rows": rows}
    pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    lines = [
        "Matmuls with int8 operands / all matmuls, `int8` preset, "
        f"jax {jax.__version__} (forward pass; gradient with respect to the "
        "parameters)",
        "",
        "| model code | API | wrappers: forward | backward "
        "| qbits.quantize: forward | backward | weights stored by serving.convert |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [
            f"{r[k][0]} of {r[k][1]}"
            for k in ("wrappers_fwd", "wrappers_bwd", "transform_fwd", "transform_bwd")
        ]
        cells.append(r["stored"])
        lines.append(f"| {r['model']} | {r['api']} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if args.md:
        pathlib.Path(args.md).write_text(table + "\n")


if __name__ == "__main__":
    main()
