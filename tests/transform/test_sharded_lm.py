"""An FSDP + tensor-parallel LM on 8 CPU devices, quantized by the one engine."""

import importlib.util
import json
import pathlib

import pytest

from tests.helpers import run_script


def test_sharded_lm_equals_unsharded_and_adds_no_resharding():
    result = run_script(pathlib.Path(__file__).with_name("sharded_lm_check.py"))
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    counts = report["collectives"]
    assert set(counts) == {"float32", "int8", "fp8_delayed"}
    if importlib.util.find_spec("jax.experimental.shard_alike") is None:
        # Values and gradient shardings are checked above; the counts below
        # are those of scales tied to what they scale (qbits._sharding.alike).
        pytest.skip("this jax has no shard_alike (0.11.2): no scale is tied")

    def ops(config, kind):
        return counts[config].get(kind, {}).get("ops", 0)

    def nbytes(config, kind):
        return counts[config].get(kind, {}).get("bytes", 0)

    # The 1-block model (benchmarks/sharded_collectives.py measures per
    # block). Each scale is tied to the array it scales (qbits._sharding.alike),
    # so XLA lays out no float operand for its codes: fewer collectives and
    # bytes in all than float32. XLA then sums partial products where float32
    # gathers operands (more all-reduces, fewer all-gathers and all-to-alls);
    # int8's per-token scales add 6 gathers (below), fp8_delayed records its
    # amaxes (2 second-stage all-reduces).
    def total(config, what):
        return sum(v[what] for v in counts[config].values())

    assert total("int8", "ops") <= total("float32", "ops") + 6
    assert total("fp8_delayed", "ops") <= total("float32", "ops") - 2
    assert total("int8", "bytes") <= 0.7 * total("float32", "bytes")
    assert total("fp8_delayed", "bytes") <= 0.75 * total("float32", "bytes")
    for config, more in (("int8", 12), ("fp8_delayed", 5)):
        for kind in ("collective-permute", "all-to-all"):
            assert ops(config, kind) <= ops("float32", kind), (config, kind)
        assert ops(config, "all-reduce") <= ops("float32", "all-reduce") + more
        assert nbytes(config, "all-reduce") <= 1.2 * nbytes("float32", "all-reduce")
    # fp8_delayed's per-tensor scales come from the amax history: no scale
    # is gathered, only 8-bit codes (as float16 on XLA:CPU, whose float
    # normalization widens an all-gather of fp8 codes after partitioning;
    # fp8 on an 8-GPU compile: benchmarks/sharded_collectives.py --target h200).
    assert ops("fp8_delayed", "all-gather") <= ops("float32", "all-gather") - 6
    assert nbytes("fp8_delayed", "all-gather") <= 0.4 * nbytes("float32", "all-gather")
    # int8 (per-channel scales): its all-gathers are int8 codes and their
    # scales (before the scales kept their shape: 124 more all-gathers, 136
    # permutes).
    assert ops("int8", "all-gather") <= ops("float32", "all-gather") - 4
    assert nbytes("int8", "all-gather") <= 0.25 * nbytes("float32", "all-gather")
    # What int8 gathers beyond its codes is scales (f32 vectors made in
    # qbits' core), never float operands. float32 has none of these roles.
    roles = report["roles"]
    assert not any(roles["float32"].values()), roles
    assert roles["int8"]["scale all-gathers"] <= 6, roles
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
