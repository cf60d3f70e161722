"""Per-layer rules: matching, the per-layer table, operand checks."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import qbits
from qbits.ops._kind import Call
from qbits.transform._checks import check_fits

DN = (((1,), (0,)), ((), ()))


def check_operands(cfg, lhs_shape, rhs_shape, dn, where=""):
    """``check_fits`` for a dot_general of operands of these shapes."""
    kind = qbits.ops.KINDS["dot_general"]
    specs = [jax.ShapeDtypeStruct(s, jnp.float32) for s in (lhs_shape, rhs_shape)]
    check_fits(cfg, kind, kind.call({"dimension_numbers": dn}, specs), (), where)


def check_conv_operands(cfg, x, k, *conv, where):
    """``check_fits`` for ``lax.conv_general_dilated(x, k, *conv)``."""
    out = jax.eval_shape(lambda a, b: lax.conv_general_dilated(a, b, *conv), x, k)
    kind = qbits.ops.KINDS["conv_general_dilated"]
    check_fits(cfg, kind, Call((x, k, *conv)), out.shape, where)


def _config():
    return qbits.QuantConfig(
        rules=(
            qbits.Rule(r".*attn/(query|key|value)", "int8_fwd"),
            qbits.Rule(r".*attn/.*", "fp8"),
            qbits.Rule(r"head", None),
            qbits.Rule(r"never/.*", "int8"),
        ),
        default="w4a8",
    )


def test_first_full_match_wins():
    qc = _config()
    assert qc.resolve("blocks_0/attn/query").name == "int8_fwd"
    assert qc.resolve("blocks_0/attn/query").rule == 0
    assert qc.resolve("blocks_0/attn/out").name == "fp8"  # rule 0 does not match
    assert qc.resolve("head").config is None and qc.resolve("head").rule == 2
    # Full match: "head" does not match "lm_head", which gets the default.
    res = qc.resolve("lm_head")
    assert res.rule is None and res.where == "default"
    assert res.config == qbits.presets.get("w4a8")


def test_table_lists_each_matmul_and_the_rules_that_matched_nothing():
    def model(p, x):
        own = qbits.dot_general("int8_fwd")  # the model's own: kept
        x = x @ p["blocks_0"]["attn"]["query"]["kernel"]
        x = x @ p["blocks_0"]["attn"]["out"]["kernel"]
        x = own(x, p["blocks_0"]["mlp"]["fc1"]["kernel"], DN)
        return x @ p["head"]["kernel"]

    w = jnp.ones((4, 4))
    params = {
        "blocks_0": {
            "attn": {"query": {"kernel": w}, "out": {"kernel": w}},
            "mlp": {"fc1": {"kernel": w}},
        },
        "head": {"kernel": w},
    }
    table = qbits.layer_table(model, _config(), params, jnp.ones((2, 4)))
    assert [r.describe() for r in table.rows] == ["int8_fwd", "fp8", "kept", "float"]
    assert table.unused_rules == (3,)
    assert "rules[3] (pattern 'never/.*') matched no matmul" in str(table)
    assert table.configs() == {
        "blocks_0/attn/query": qbits.presets.get("int8_fwd"),
        "blocks_0/attn/out": qbits.presets.get("fp8"),
        "head": None,
    }
    data = table.as_dicts()
    assert data[0]["source"] == "rules[0].config"
    assert data[0]["resolved"] == qbits.config._to_dict(qbits.presets.get("int8_fwd"))
    assert data[2]["source"] == "kept: inside custom_vjp"
    assert data[3]["resolved"] is None
    assert table["head"].kind == "dot_general (activation x weight)"
    assert table["head"].operands == "f32[2,4] x f32[4,4]"
    with pytest.warns(qbits.config.UnusedRuleWarning, match="never"):
        table.warn_unused()


def test_later_uses_of_a_name_are_numbered_and_matched_by_its_rules():
    def twice(p, x):
        return (x @ p["fc"]) @ p["fc"].T

    rules = qbits.QuantConfig(
        rules=(qbits.Rule(r"fc\#2", None), qbits.Rule("fc", "int8_fwd"))
    )
    table = qbits.layer_table(twice, rules, {"fc": jnp.ones((4, 4))}, jnp.ones((2, 4)))
    assert [(r.path, r.describe()) for r in table.rows] == [
        ("fc", "int8_fwd"),
        ("fc#2", "float"),
    ]
    assert rules.resolve("fc#3").name == "int8_fwd"  # a rule for fc reaches it


def test_inline_configs_and_an_empty_config():
    inline = qbits.presets.get("int4_fwd")
    qc = qbits.QuantConfig(rules=[qbits.Rule("a", inline)])
    assert qc.rules == (qbits.Rule("a", inline),)
    assert qc.resolve("a").config == inline and qc.resolve("a").name is None
    assert qbits.QuantConfig().resolve("anything").config is None


def test_check_operands_names_the_matmul_and_operand_that_does_not_fit():
    cfg = qbits.presets.get("int4_weight_only")
    check_operands(cfg, (4, 256), (256, 8), DN, "rules[0].config")
    with pytest.raises(qbits.ConfigError) as info:
        check_operands(cfg, (4, 200), (200, 8), DN, "rules[0].config")
    assert info.value.path == "rules[0].config.fwd.rhs.granularity.tile_size"
    assert "a divisor of 200" in str(info.value)
    # MXFP8 tiles the backward matmuls along the output features: 8 is too few.
    with pytest.raises(qbits.ConfigError) as info:
        check_operands(qbits.presets.get("mxfp8"), (4, 64), (64, 8), DN, "default")
    assert info.value.path == "default.dlhs.lhs.granularity.tile_size"
    # ... and the weight gradient contracts over the batch: 4 rows are too few.
    with pytest.raises(qbits.ConfigError, match=r"^drhs\.lhs\.granularity"):
        check_operands(qbits.presets.get("mxfp8"), (4, 64), (64, 32), DN)
    check_operands(qbits.presets.get("mxfp8"), (32, 64), (64, 32), DN)


def test_check_conv_operands_uses_the_axes_each_convolution_contracts():
    conv = ((1, 1), "SAME", None, None, ("NHWC", "HWIO", "NHWC"))
    x, k = jnp.ones((8, 4, 4, 32)), jnp.ones((3, 3, 32, 16))
    for name in ("int8", "fp8", "int4_fwd"):
        check_conv_operands(qbits.presets.get(name), x, k, *conv, where="default")
    # Tiles of 32 along the input channels fit 32 channels, not 16.
    tiled = qbits.Quantizer(qbits.IntNumerics(bits=8), granularity=qbits.Tiled(3, 32))
    cfg = qbits.DotGeneralConfig(fwd=qbits.MatmulConfig(lhs=tiled))
    check_conv_operands(cfg, x, k, *conv, where="rules[0].config")
    with pytest.raises(qbits.ConfigError) as info:
        check_conv_operands(cfg, x[..., :16], k[:, :, :16], *conv, where="default")
    assert info.value.path == "default.fwd.lhs.granularity.tile_size"
    # MX tiles a convolution's feature axis (its last contracting axis).
    mx, k32 = qbits.presets.get("mxfp8"), jnp.ones((3, 3, 32, 32))
    x32 = jnp.ones((8, 4, 32, 32))  # the weight gradient tiles the last position
    check_conv_operands(mx, x32, k32, *conv, where="default")
    with pytest.raises(qbits.ConfigError) as info:
        check_conv_operands(mx, x32[..., :16], k32[:, :, :16], *conv, where="d")
    assert info.value.path == "d.fwd.lhs.granularity.tile_size"


# Patterns Python's backtracking `re` could take exponential (or high
# polynomial) time to match: refused when the rule is made.
SLOW_PATTERNS = [
    r"(h+)*x",  # a quantifier over a quantifier
    r"(fc|fc1)+/kernel",  # over an alternation whose branches overlap
    r"(blocks/.*){3}",  # a fixed count of a variable group
    r"(x)\1+y",  # over a backreference
    r".*/.*/.*/.*/.*/head",  # five unbounded quantifiers
    "".join(f"(l{i}/)?" for i in range(17)),  # seventeen optional groups
]


@pytest.mark.parametrize("pattern", SLOW_PATTERNS)
def test_patterns_that_could_match_in_exponential_time_are_refused(pattern):
    with pytest.raises(qbits.ConfigError) as info:
        qbits.Rule(pattern, "int8")
    e = info.value
    assert e.path == "pattern" and e.value == pattern
    assert "matches in bounded time" in e.allowed
    assert "exponential time" in e.why


@pytest.mark.parametrize(
    "pattern",
    [
        r".*attn/(query|key|value)",
        r"blocks/[0-9]+/mlp/fc[12]",
        r"(encoder|decoder)/layers_\d+/.*",
        r"(.*/)?head",
        r"([0-9]{2}/)+x",  # a fixed-length group repeated
        r"(\w|_)+/head",  # the parser makes one character class of it
        r"(?:ab|ac)*",  # the parser factors the common prefix out: no '|' left
        r".*/.*/.*/.*",
    ],
)
def test_usual_patterns_are_accepted(pattern):
    assert qbits.Rule(pattern, None).pattern == pattern
