"""An FSDP + tensor-parallel LM on 8 CPU devices, quantized by the one engine."""

import json
import pathlib

from tests.helpers import run_script


def test_sharded_lm_equals_unsharded_and_adds_no_resharding():
    result = run_script(pathlib.Path(__file__).with_name("sharded_lm_check.py"))
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    counts = report["collectives"]
    assert set(counts) == {"float32", "int8", "fp8_delayed"}

    def ops(config, kind):
        return counts[config].get(kind, {}).get("ops", 0)

    def nbytes(config, kind):
        return counts[config].get(kind, {}).get("bytes", 0)

    # The 1-block model (benchmarks/sharded_collectives.py measures per
    # block). No codes or scales are re-laid out across devices: no
    # permutes or all-to-alls beyond float32's; the all-reduces move
    # float32's bytes (the gradient reductions) plus small amaxes.
    for config in ("int8", "fp8_delayed"):
        for kind in ("collective-permute", "all-to-all"):
            assert ops(config, kind) <= ops("float32", kind), (config, kind)
        assert nbytes(config, "all-reduce") <= 1.05 * nbytes("float32", "all-reduce")
    # Per-tensor scales from the amax history: float32's all-gathers, of
    # 8-bit codes (as float16 on XLA:CPU, whose float normalization widens
    # an all-gather of fp8 codes after partitioning; fp8 on an 8-GPU
    # compile: benchmarks/sharded_collectives.py --target h200); a few
    # all-reduces record the amaxes.
    assert ops("fp8_delayed", "all-gather") == ops("float32", "all-gather")
    assert nbytes("fp8_delayed", "all-gather") <= 0.55 * nbytes("float32", "all-gather")
    assert ops("fp8_delayed", "all-reduce") <= ops("float32", "all-reduce") + 3
    # int8 (per-channel scales): an all-gather of int8 codes travels with
    # one of its scales (1/K of its elements), 8 in this model (before the
    # scales kept their shape: 124 more all-gathers, 136 permutes); the
    # per-channel amaxes over FSDP-sharded axes are reduced (11 all-reduces).
    assert ops("int8", "all-gather") <= ops("float32", "all-gather") + 8
    assert nbytes("int8", "all-gather") <= 0.35 * nbytes("float32", "all-gather")
    assert ops("int8", "all-reduce") <= ops("float32", "all-reduce") + 11
    # What int8 adds to float32's all-gathers is scales (f32 vectors made in
    # qbits' core), never codes: its codes are gathered where float32
    # gathers its operands. float32 has none of these roles.
    roles = report["roles"]
    assert not any(roles["float32"].values()), roles
    scales = roles["int8"]["scale all-gathers"]
    assert ops("int8", "all-gather") - scales == ops("float32", "all-gather"), roles
    # Of those, the ones XLA's sharding propagation adds by computing a
    # scale on the batch's rows of an amax every device holds (then
    # gathering it back, docs/guides/large-models.md): 3 in this model,
    # the per-token scales of the inputs of qkv, fc1 and the head.
    assert roles["int8"]["of them, slices of a replicated value"] <= 3, roles
    # No amax reduced in two stages beyond what XLA's partitioner does for a
    # reduce over a tensor tiled on two mesh axes: none for int8 (each
    # per-channel or per-token amax spans one sharded axis), 2 for
    # fp8_delayed's recorded amaxes (outside the block).
    assert roles["int8"]["second-stage all-reduces"] == 0, roles
    assert roles["fp8_delayed"]["second-stage all-reduces"] <= 2, roles
    # 8-bit weights on the wire: an FSDP weight is gathered as codes.
    weights = report["weights"]
    assert weights["int8"] <= 0.3 * weights["float32"], weights
