"""Standard quantized checkpoints: qbits' reads and writes against the references.

Read: every checkpoint of tests/data/quantized (written by AutoGPTQ 0.7.1,
compressed-tensors 0.20.0 and AutoAWQ 0.2.9,
tests/data/make_quantized_checkpoints.py and make_more_checkpoints.py),
read by ``qbits.interop.read_checkpoint``: are its dequantized weights the
reference's bit for bit (GPTQ's and AWQ's dequantize in float16,
compressed-tensors' NVFP4 in bfloat16), how far
is the served matmul from the reference weights' float matmul (the
weights alone: a checkpoint that also quantizes its inputs, W8A8, is
served here with float inputs; tests/interop/test_inputs.py checks its
inputs against the reference's), and how many bytes are held per float32
byte.

Write: qbits PTQ results (RTN and GPTQ, int4 groups sym/asym, int8 per
channel; AWQ of the example LM with its scales folded into the layers
before, whose served logits are compared with the float LM on the
reference's weights; FP8 E4M3 per tensor and per channel, compressed-tensors'
``float-quantized`` only; NVFP4, ``nvfp4-pack-quantized``) written by
``qbits.interop.write_checkpoint`` and read back by the reference
libraries themselves (tests/data/reference_read.py, run in the reference
venv): are the reference's dequantized weights qbits' bit for bit (NVFP4:
its codes and E4M3 scales, and its bfloat16 ``decompress``; the float32
weights' distance in ulps recorded), do the loaders leave exactly the
float layers float (``qbits export``'s, written beside the quantized
ones), and how many bytes are held per float32 byte. Read rows also give
each checkpoint's own bytes (``Checkpoint.stored_bytes``). GPTQ gets
float16 scales where they are exact
(a checkpoint qbits read, written back), float32 ones otherwise (qbits'
PTQ scales: a float32 model's GPTQ checkpoint, which AutoGPTQ reads in
float32).

Run: python benchmarks/checkpoint_formats.py [--refvenv /work/refvenv]
[--read-only] (writes benchmarks/results/checkpoint_formats.json and .md).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import qbits
import qbits.interop
from qbits.numerics import Fp8Numerics, IntNumerics, UintNumerics

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "quantized"
NAMES = {"q": "model.layers.0.self_attn.q_proj", "o": "model.layers.0.self_attn.o_proj"}


def _fn(p, x):
    return (x @ p["q"]) @ p["o"]


def read_rows() -> list[dict]:
    rows = []
    for d in sorted(DATA.iterdir()):
        if d.name == "ct_qbits_lm":  # the example LM's: tests/interop serves it
            continue
        ref = np.load(d / "reference.npz")
        try:
            ckpt = qbits.interop.read_checkpoint(d)
        except qbits.InvalidArgumentError as e:
            rows.append({"checkpoint": d.name, "refused": str(e).split(" is not")[0]})
            continue
        exact, err, held, floats = True, 0.0, 0, 0
        for m, qt in ckpt.weights.items():
            w = np.asarray(qt.dequant()).T
            order = ckpt.input_orders.get(m)
            if order is not None:  # act-order: rows are the inputs sorted by group
                w = w[:, np.argsort(order)]
                held += order.nbytes
            if ckpt.format.startswith(("gptq", "awq")):  # float16 references
                w = w.astype(np.float16).astype(np.float32)
            elif ckpt.format.endswith("nvfp4-pack-quantized"):  # bfloat16's
                w = w.astype(ml_dtypes.bfloat16).astype(np.float32)
            exact &= bool(np.array_equal(w, ref[f"weight/{m}"]))
            held += qt.nbytes
            floats += 4 * int(np.prod(qt.shape))
        params = {
            "q": jax.ShapeDtypeStruct((64, 32), jnp.float32),
            "o": jax.ShapeDtypeStruct((32, 32), jnp.float32),
        }
        x = jnp.asarray(ref["x"][:, :64])
        only = qbits.interop.Checkpoint(
            ckpt.format,
            ckpt.weights,
            ckpt.quantizers,
            {},
            ckpt.quantization_config,
            ckpt.input_orders,
        )
        names = [(r".*\.(q|o)_proj\.weight", r"\1")]
        sp, config = qbits.interop.serving_params(only, _fn, params, x, names=names)
        got = np.asarray(qbits.serving.serve(_fn, config)(sp, x))
        # the reference's float32 weights where it has them (NVFP4's)
        fp32 = "weight32" if f"weight32/{NAMES['q']}" in ref else "weight"
        want = ref["x"][:, :64] @ ref[f"{fp32}/{NAMES['q']}"].T
        want = want @ ref[f"{fp32}/{NAMES['o']}"].T
        err = float(np.abs(got - want).max() / np.abs(want).max())
        q = ckpt.weights[NAMES["q"]]
        grid = ckpt.quantizers[NAMES["q"]].granularity
        rows.append(
            {
                "checkpoint": d.name,
                "format": ckpt.format,
                "qbits": f"{'NF4 ' if q.codebook else ''}{q.qdtype.name}, "
                f"{type(grid).__name__}"
                + (
                    f" {grid.tile_size} x {grid.free_tile_size}"
                    if getattr(grid, "free_tile_size", 1) > 1
                    else ""
                )
                + (", zero points" if q.zero_point is not None else "")
                + (", input order" if ckpt.input_orders else "")
                + (", E4M3 scales, tensor scale" if q.tensor_scale is not None else "")
                + (", 8-bit scales" if q.scale_absmax is not None else "")
                + _inputs(ckpt.activations.get(NAMES["q"])),
                "bit_exact": exact,
                "served_rel_err": err,
                "bytes_per_float32_byte": held / floats,
                # in the checkpoint's files (bitsandbytes' 8-bit absmax)
                "file_bytes_per_float32_byte": sum(ckpt.stored_bytes.values()) / floats,
            }
        )
    return rows


def _inputs(q) -> str:
    """The inputs the checkpoint quantizes (W8A8), e.g. ``; inputs int8 per token``."""
    if q is None:
        return ""
    per = {"PerChannel": "per token", "PerTensor": "per tensor"}.get(
        type(q.granularity).__name__, "per token and block"
    )
    static = " static" if hasattr(q.calibration, "value") else ""
    return f"; inputs {q.numerics.get_dtype().name} {per}{static}"


def _ptq(method: str, quantizer) -> dict:
    key = jax.random.key(0)
    params = {
        "q": 0.05 * jax.random.normal(key, (64, 32)),
        "o": 0.05 * jax.random.normal(jax.random.fold_in(key, 1), (32, 32)),
    }
    batches = [jax.random.normal(jax.random.fold_in(key, 2), (32, 64))]
    config = qbits.DotGeneralConfig(fwd=qbits.MatmulConfig(rhs=quantizer))
    result = qbits.ptq.quantize_weights(_fn, params, batches, config, method=method)
    return {NAMES[k]: v for k, v in result.stored.items()}


def _reference(folder: pathlib.Path, refvenv: pathlib.Path) -> dict | str:
    out = folder / "reference.npz"
    run = subprocess.run(
        [
            str(refvenv / "bin" / "python"),
            str(ROOT / "tests/data/reference_read.py"),
            str(folder),
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    if run.returncode:
        return run.stderr.strip().splitlines()[-1]
    return dict(np.load(out))


def _lm_cases(grids: dict) -> list[tuple]:
    """``qbits export``'s checkpoints of the example LM (tiny, random weights).

    GPTQ results in groups of 8 (the tiny LM is 16 wide), as the command
    writes them (PyTorch names, ``[in, out]`` weights; a weight the format
    cannot hold stays float: GPTQ's 45-token head, whose codes are not
    whole int32 words, and uint4 groups whose zero point lies outside
    0..15).
    """
    from qbits._experiments import build_model, spec
    from qbits._experiments._ptq import lm_fold
    from qbits.cli._interop import _torch_layout

    model, data = build_model(spec("lm", "tiny"), 0)
    fn, params = qbits.nnx.as_function(model)
    key = jax.random.key(0)
    batches = [jax.random.randint(key, (4, 16), 0, data.vocab)]
    g8 = qbits.Tiled(tile_size=8)
    lm_grids = {
        "int4 g8 sym": qbits.Quantizer(IntNumerics(bits=4), qbits.AbsMax(), g8),
        "uint4 g8 asym": qbits.Quantizer(UintNumerics(bits=4), qbits.AbsMax(), g8),
        "int8 per channel": grids["int8 per channel"],
        "fp8 per channel": grids["fp8 per channel"],
        "nvfp4": grids["nvfp4"],
    }
    cases = []
    for method, grid in [*(("gptq", g) for g in lm_grids), *AWQ_GRIDS]:
        q = lm_grids[grid]
        config = qbits.DotGeneralConfig(fwd=qbits.MatmulConfig(rhs=q))
        fold = {"fold": lm_fold(1)} if method == "awq" else {}
        result = qbits.ptq.quantize_weights(
            fn, params, batches, config, method=method, **fold
        )
        for fmt in ("compressed-tensors", "gptq"):
            if fmt == "gptq" and grid.startswith(("fp8", "nvfp4")):
                continue
            weights, tensors = _torch_layout(model, result, fmt)  # floats beside
            source = f"qbits export, example LM, {method} {grid}"
            served = None
            if method == "awq":  # qbits' served AWQ model, for the logits:
                # the stored weights from their codes; a weight serving cannot
                # store (out's groups of 8 span its heads axis) in float, as
                # the PTQ result has it (convert would quantize it again)
                only = qbits.QuantConfig(
                    rules=tuple(
                        qbits.Rule(re.escape(path), config) for path in result.stored
                    ),
                    default=None,
                )
                sp = qbits.serving.convert(fn, only, result, batches[0])
                served = (fn, params, batches[0], sp, only)
            cases.append((source, weights, fmt, tensors, served))
    return cases


# AWQ (scales folded into the layers before: qbits export --method awq).
AWQ_GRIDS = [
    ("awq", "int4 g8 sym"),
    ("awq", "uint4 g8 asym"),
    ("awq", "int8 per channel"),
]


def _served_rel_err(served, folder: pathlib.Path, ref: dict) -> float:
    """qbits' served AWQ LM against the float LM on the reference's weights
    (and the checkpoint's float tensors: the folded norms): logits' largest
    difference over their largest magnitude."""
    fn, params, tokens, sp, config = served
    mine, _ = qbits.serving.serve(fn, config)(sp, tokens)
    ckpt = qbits.interop.read_checkpoint(folder)
    floats_sp, _ = qbits.interop.serving_params(
        ckpt, fn, params, tokens, names="qbits-lm"
    )
    floats = {
        info.param: jnp.asarray(
            ref[f"weight/{info.path.replace('/', '.')}"].T.reshape(info.param_shape)
        )
        for info in floats_sp.layers
    }
    leaves, treedef = jax.tree_util.tree_flatten_with_path(floats_sp.params)
    float_params = jax.tree.unflatten(
        treedef, [floats.get(jax.tree_util.keystr(p), x) for p, x in leaves]
    )
    want, _ = fn(float_params, tokens)
    return float(jnp.abs(mine - want).max() / jnp.abs(want).max())


def write_rows(refvenv: pathlib.Path) -> list[dict]:
    g16 = qbits.Tiled(tile_size=16)
    grids = {
        "int4 g16 sym": qbits.Quantizer(IntNumerics(bits=4), qbits.AbsMax(), g16),
        "uint4 g16 asym": qbits.Quantizer(UintNumerics(bits=4), qbits.AbsMax(), g16),
        "int8 per channel": qbits.Quantizer(
            IntNumerics(bits=8), qbits.AbsMax(), qbits.PerChannel()
        ),
    }
    fp8 = Fp8Numerics("float8_e4m3fn")
    grids["fp8 per tensor"] = qbits.Quantizer(fp8, qbits.AbsMax(), qbits.PerTensor())
    grids["fp8 per channel"] = qbits.Quantizer(fp8, qbits.AbsMax(), qbits.PerChannel())
    grids["nvfp4"] = qbits.presets.get("nvfp4_weight_only").fwd.rhs
    cases = [
        (f"qbits {method} {grid}", _ptq(method, q), fmt)
        for method in ("rtn", "gptq")
        for grid, q in grids.items()
        for fmt in ("compressed-tensors", "gptq")
        if fmt == "compressed-tensors" or not grid.startswith(("fp8", "nvfp4"))
    ]
    cases += _lm_cases(grids)
    for name in ("gptq_w4g16_asym", "gptq_w8g32_sym"):
        ckpt = qbits.interop.read_checkpoint(DATA / name)
        for fmt in ("gptq", "gptq_v2"):
            cases.append((f"read {name}", dict(ckpt.weights), fmt, {}))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (source, weights, fmt, *more) in enumerate(cases):
            tensors, served = (*more, None)[:2] if more else ({}, None)
            held = sum(qt.nbytes for qt in weights.values())
            floats = sum(4 * int(np.prod(qt.shape)) for qt in weights.values())
            row = {"source": source, "format": fmt}
            row["bytes_per_float32_byte"] = held / floats
            folder = pathlib.Path(tmp) / str(i)
            try:
                qbits.interop.write_checkpoint(folder, weights, fmt, tensors=tensors)
            except qbits.InvalidArgumentError as e:
                row["refused"] = str(e).split("(")[1].split(")")[0]
                rows.append(row)
                continue
            ref = _reference(folder, refvenv)
            if isinstance(ref, str):
                row["reference_error"] = ref
            else:
                exact = True
                half = all(
                    np.array_equal(np.asarray(qt.scale, np.float16), qt.scale)
                    for qt in weights.values()
                )
                row["gptq_scales"] = (
                    ("float16" if half else "float32")
                    if (fmt.startswith("gptq"))
                    else None
                )
                for m, qt in weights.items():
                    w = np.asarray(qt.dequant()).T
                    if fmt.startswith("gptq") and half:  # the reference: in float16
                        w = w.astype(np.float16).astype(np.float32)
                    if qt.tensor_scale is not None:  # NVFP4
                        exact &= _nvfp4_exact(qt, ref, m, row)
                        w = w.astype(ml_dtypes.bfloat16).astype(np.float32)
                    exact &= bool(np.array_equal(w, ref[f"weight/{m}"]))
                row["reference_bit_exact"] = exact
                # Linear layers the loader left float (reference_read.py fails
                # unless they are exactly the checkpoint's float ones)
                row["float_layers"] = sorted(k[6:] for k in ref if k[:6] == "float/")
                if served is not None:
                    row["served_rel_err"] = _served_rel_err(served, folder, ref)
            rows.append(row)
    return rows


def _nvfp4_exact(qt, ref: dict, m: str, row: dict) -> bool:
    """NVFP4 read by compressed-tensors: its codes and E4M3 scales qbits' bit
    for bit (``decompress``'s bfloat16 weights are compared by the caller);
    its float32 weights' largest distance from qbits' in ulps goes in
    ``row`` (its ``scale / global_scale`` against ``scale * tensor_scale``)."""
    u = qt.unpack()
    exact = all(
        np.array_equal(ref[f"{part}/{m}"], np.asarray(mine).astype(np.float32).T)
        for part, mine in (("codes", u.qvalue), ("scale", u.scale))
    )
    mine = np.asarray(qt.dequant()).T.view(np.int32).astype(np.int64)
    ulps = int(np.abs(ref[f"weight32/{m}"].view(np.int32) - mine).max())
    row["float32_ulps"] = max(row.get("float32_ulps", 0), ulps)
    return exact


def _md(result: dict) -> str:
    head = (
        "| checkpoint | format | qbits stores | bit-exact | served rel. err | bytes "
        "held | bytes in file |"
    )
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in result["read"]:
        if "refused" in r:
            lines.append(f"| {r['checkpoint']} | | refused | | | | |")
            continue
        lines.append(
            f"| {r['checkpoint']} | {r['format']} | {r['qbits']} | {r['bit_exact']} | "
            f"{r['served_rel_err']:.1e} | {r['bytes_per_float32_byte']:.3f} | "
            f"{r['file_bytes_per_float32_byte']:.3f} |"
        )
    lines += [
        "",
        "| written from | format | reference read: bit-exact | served rel. err "
        "| bytes |",
        "|---|---|---|---|---|",
    ]
    for r in result["write"]:
        what = r.get("reference_bit_exact", r.get("refused", r.get("reference_error")))
        scales = f" ({r['gptq_scales']} scales)" if r.get("gptq_scales") else ""
        if r.get("float_layers"):
            scales += f" ({len(r['float_layers'])} 2-D float weights kept float)"
        if "float32_ulps" in r:  # NVFP4: codes and scales, bfloat16 weights
            scales += f" (float32 weights within {r['float32_ulps']} ulps)"
        size = f"{r['bytes_per_float32_byte']:.3f}"
        err = f"{r['served_rel_err']:.1e}" if "served_rel_err" in r else ""
        lines.append(
            f"| {r['source']} | {r['format']}{scales} | {what} | {err} | {size} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--refvenv", default="/work/refvenv", type=pathlib.Path)
    parser.add_argument(
        "--read-only",
        action="store_true",
        help="measure the reads again; keep the write rows of the last run",
    )
    args = parser.parse_args()
    out = ROOT / "benchmarks" / "results" / "checkpoint_formats"
    result = {
        "what": "qbits.interop vs AutoGPTQ 0.7.1 and compressed-tensors 0.20.0, CPU",
        "read": read_rows(),
        "write": json.loads(out.with_suffix(".json").read_text())["write"]
        if args.read_only
        else write_rows(args.refvenv),
    }
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(_md(result))
    print(_md(result))


if __name__ == "__main__":
    sys.exit(main())
