"""Configs as data and YAML: round trips, presets, bad files."""

import os
import pathlib
import re
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from hypothesis import assume, given
from hypothesis import strategies as st

import qbits
from qbits import config as qc
from qbits._formats import FLOAT_FORMATS

ROOT = pathlib.Path(__file__).resolve().parents[2]
FORMATS = sorted(FLOAT_FORMATS)


@pytest.mark.parametrize("name", qbits.presets.names())
def test_every_preset_round_trips_through_yaml_and_dicts(name):
    cfg = qbits.presets.get(name)
    assert qbits.load_config(qc.dump(cfg), None) == cfg
    assert qbits.load_config(qc._to_dict(cfg), qbits.DotGeneralConfig) == cfg
    # The dump is plain data: safe_dump accepts it, safe_load gives it back.
    data = qc._to_dict(cfg)
    assert yaml.safe_load(yaml.safe_dump(data)) == data


@pytest.mark.parametrize("name", qbits.presets.names())
def test_configs_folder_holds_every_preset_and_is_current(name):
    path = ROOT / "configs" / f"{name}.yaml"
    assert path.read_text() == qc._yamlio.preset_yaml(name), (
        f"{path} is stale: run python -c "
        "\"import qbits; qbits.config._yamlio.write_presets('configs')\""
    )
    assert qbits.load_config(path, None) == qbits.presets.get(name)
    assert qbits.load_config(path).default == qbits.presets.get(name)
    # The header says what it is for and which work it follows.
    assert "arXiv" in path.read_text() or name == "none"


def test_presets_are_what_their_names_say():
    get = qbits.presets.get
    assert get("none").is_identity
    int8_fwd = get("int8_fwd")
    assert int8_fwd.fwd.lhs.numerics == qbits.IntNumerics(bits=8)
    assert int8_fwd.fwd.lhs.granularity == qbits.PerChannel()
    assert int8_fwd.dlhs.is_identity and int8_fwd.drhs.is_identity
    int8 = get("int8")
    assert int8.needs_key and not int8_fwd.needs_key
    assert int8.dlhs.lhs.numerics.noise_fn is not None
    assert int8.dlhs.rhs.numerics.noise_fn is None
    assert get("w4a8").fwd.rhs.numerics.bits == 4
    assert get("w4a8").fwd.lhs.numerics.bits == 8
    wo = get("int4_weight_only").fwd
    assert wo.lhs.numerics == qbits.numerics.NoNumerics()
    assert wo.rhs.granularity == qbits.Tiled(tile_size=128)
    fp8 = get("fp8")
    assert fp8.fwd.lhs.numerics.dtype.name == "float8_e4m3fn"
    for bwd in (fp8.dlhs, fp8.drhs):
        assert bwd.lhs.numerics.dtype.name == "float8_e5m2"
        assert bwd.rhs.numerics.dtype.name == "float8_e4m3fn"
    assert fp8.fwd.lhs.granularity == qbits.PerTensor()
    for name, element in (("mxfp8", "float8_e4m3fn"), ("mxfp4", "float4_e2m1fn")):
        q = get(name).fwd.rhs
        assert q.numerics.dtype.name == element
        assert q.granularity == qbits.Tiled(tile_size=32)
        assert q.scale_rounding == "e8m0"
    assert set(qbits.presets.names()) >= {
        "none", "int8_fwd", "int8", "int4_fwd", "w4a8", "int4_weight_only",
        "fp8", "mxfp8", "mxfp4",
    }  # fmt: skip


@st.composite
def quantizers(draw):
    kind = draw(st.sampled_from(["int", "fp", "none"]))
    noise = draw(st.sampled_from([None, qbits.numerics.UniformNoise()]))
    if kind == "int":
        bits = draw(st.integers(1, 16))
        numerics = qbits.IntNumerics(
            bits=bits,
            preserve_zero=bits > 1 and draw(st.booleans()),
            preserve_max_val=draw(st.booleans()),
            clip=draw(st.booleans()),
            clip_gradient=draw(st.booleans()),
            round=draw(st.booleans()),
            noise_fn=noise,
        )
    elif kind == "fp":
        numerics = qbits.FpNumerics(
            draw(st.sampled_from(FORMATS)),
            clip=draw(st.booleans()),
            clip_gradient=draw(st.booleans()),
            noise_fn=noise,
        )
    else:
        numerics = qbits.numerics.NoNumerics()
    calibration = draw(
        st.sampled_from(
            [
                qbits.AbsMax(),
                qbits.AbsMax(clip_factor=0.9),
                qbits.Percentile(99.5),
                qbits.MseSearch(clip_factors=(1.0, 0.8)),
                qbits.ConstantBound(2.5),
            ]
        )
    )
    granularity = draw(
        st.sampled_from(
            [
                qbits.PerTensor(),
                qbits.PerChannel(),
                qbits.PerChannel(shared_axes=(0, -1)),
                qbits.Tiled(tile_size=16),
                qbits.Tiled(axis=-1, tile_size=8, shared_axes=(0,)),
            ]
        )
    )
    rounding = draw(st.sampled_from(["none", "pow2", "e8m0"]))
    return qbits.Quantizer(numerics, calibration, granularity, rounding)


@given(
    st.lists(quantizers(), min_size=6, max_size=6),
    st.sampled_from(["real", "fake"]),
    st.sampled_from([None, "int32", "float32"]),
)
def test_any_config_round_trips(qs, mode, accumulator):
    try:
        mms = [
            qbits.MatmulConfig(qs[i], qs[i + 1], mode=mode, accumulator=accumulator)
            for i in (0, 2, 4)
        ]
    except qbits.InvalidArgumentError:
        assume(False)
    cfg = qbits.DotGeneralConfig(*mms)
    assert qbits.load_config(qc.dump(cfg), None) == cfg


def test_multi_rule_file_round_trips(tmp_path):
    text = """
rules:
  - pattern: '.*attn/(query|key|value|out)'
    config: int8_fwd
  - pattern: '.*attn/(qk|pv)'
    config:
      fwd:
        lhs: {numerics: {type: fp8, dtype: float8_e4m3fn}, granularity: per_tensor}
        rhs: {numerics: {type: fp8}, granularity: per_tensor}
  - pattern: '.*mlp.*'
    config: w4a8
  - pattern: head
    config: null
default: int8
"""
    path = tmp_path / "rules.yaml"
    path.write_text(text)
    loaded = qbits.load_config(path)
    assert [r.config for r in loaded.rules][::2] == ["int8_fwd", "w4a8"]
    assert loaded.rules[3].config is None and loaded.default == "int8"
    qc.dump(loaded, tmp_path / "again.yaml")
    assert qbits.load_config(tmp_path / "again.yaml") == loaded
    assert qbits.load_config(qc._to_dict(loaded), qbits.QuantConfig) == loaded


def test_single_config_and_preset_name_files_become_defaults(tmp_path):
    (tmp_path / "a.yaml").write_text("int4_fwd\n")
    assert qbits.load_config(tmp_path / "a.yaml").default == qbits.presets.get(
        "int4_fwd"
    )
    (tmp_path / "b.yaml").write_text("fwd: {rhs: {numerics: {type: int, bits: 3}}}")
    qcfg = qbits.load_config(tmp_path / "b.yaml")
    assert qcfg.rules == () and qcfg.default.fwd.rhs.numerics.bits == 3


# ---------------------------------------------------------------------------
# Bad files: one exception type, naming the path, the value and what is allowed.

BAD_FILES = [
    # (name, yaml, path in the message, text the message must contain)
    ("empty", "", "", "the document is empty"),
    ("only a comment", "# nothing\n", "", "the document is empty"),
    ("list at top", "- a\n- b\n", "", "a mapping"),
    ("number at top", "42\n", "", "got 42"),
    ("unknown preset at top", "int9\n", "", "int8_fwd"),
    ("unknown top key", "fwdd: {}\n", "fwdd", "fwd, dlhs, drhs"),
    ("mixed kinds of keys", "fwd: {}\nrules: []\n", "fwd", "both kinds"),
    (
        "python tag",
        "fwd: !!python/object/apply:os.system ['echo hi']\n",
        "",
        "plain YAML",
    ),
    ("python name tag", "default: !!python/name:os.system\n", "", "plain YAML"),
    ("syntax error", "fwd: {lhs: [}\n", "", "valid YAML"),
    ("duplicate key", "fwd: {}\nfwd: {}\n", "", "duplicate key at line 2"),
    (
        "unknown field",
        "fwd: {lhs: {numerics: {type: int, bitz: 8}}}\n",
        "fwd.lhs.numerics.bitz",
        "preserve_zero",
    ),
    (
        "bits out of range",
        "rules:\n- {pattern: a, config: null}\n- pattern: b\n  config:\n"
        "    fwd: {rhs: {numerics: {type: int, bits: 32}}}\n",
        "rules[1].config.fwd.rhs.numerics.bits",
        "an int in 1..16, got 32",
    ),
    (
        "bits wrong type",
        "fwd: {rhs: {numerics: {type: int, bits: '8'}}}\n",
        "fwd.rhs.numerics.bits",
        "got '8'",
    ),
    (
        "bool wrong type",
        "fwd: {rhs: {numerics: {type: int, clip: maybe}}}\n",
        "fwd.rhs.numerics.clip",
        "True or False",
    ),
    (
        "storage dtype too small",
        "fwd: {rhs: {numerics: {type: int, bits: 8, dtype: int4}}}\n",
        "fwd.rhs.numerics.dtype",
        "int4",
    ),
    (
        "unknown float format",
        "fwd: {rhs: {numerics: {type: fp, dtype: float7_e3m3}}}\n",
        "fwd.rhs.numerics.dtype",
        "float8_e4m3fn",
    ),
    (
        "fp8 numerics with a 4-bit format",
        "fwd: {rhs: {numerics: {type: fp8, dtype: float4_e2m1fn}}}\n",
        "fwd.rhs.numerics.dtype",
        "float8",
    ),
    (
        "missing required field",
        "fwd: {rhs: {numerics: {type: fp}}}\n",
        "fwd.rhs.numerics.dtype",
        "required",
    ),
    (
        "unknown numerics type",
        "fwd: {rhs: {numerics: {type: posit}}}\n",
        "fwd.rhs.numerics.type",
        "int, fp, fp8, none",
    ),
    (
        "numerics without a type",
        "fwd: {rhs: {numerics: {bits: 8}}}\n",
        "fwd.rhs.numerics.type",
        "int, fp",
    ),
    (
        "unknown calibration",
        "fwd: {rhs: {numerics: int, calibration: minmax}}\n",
        "fwd.rhs.calibration",
        "absmax, percentile, mse, constant",
    ),
    (
        "percentile out of range",
        "fwd: {rhs: {numerics: int, calibration: {type: percentile, "
        "percentile: 120}}}\n",
        "fwd.rhs.calibration.percentile",
        "120",
    ),
    (
        "empty clip factor list",
        "fwd: {rhs: {numerics: int, calibration: {type: mse, clip_factors: []}}}\n",
        "fwd.rhs.calibration.clip_factors",
        "non-empty",
    ),
    (
        "negative clip factor in a list",
        "fwd: {rhs: {numerics: int, calibration: {type: mse, "
        "clip_factors: [1.0, -0.5]}}}\n",
        "fwd.rhs.calibration.clip_factors[1]",
        "-0.5",
    ),
    (
        "tile size zero",
        "fwd: {rhs: {numerics: int, granularity: {type: tiled, tile_size: 0}}}\n",
        "fwd.rhs.granularity.tile_size",
        "an int >= 1",
    ),
    (
        "unknown scale rounding",
        "fwd: {rhs: {numerics: int, scale_rounding: pow3}}\n",
        "fwd.rhs.scale_rounding",
        "e8m0",
    ),
    ("unknown mode", "fwd: {mode: approximate}\n", "fwd.mode", "'real' or 'fake'"),
    (
        "bad accumulator",
        "fwd: {accumulator: int8}\n",
        "fwd.accumulator",
        "int32 or float32",
    ),
    (
        "use_fwd_quant on the forward",
        "fwd: {use_fwd_quant: true}\n",
        "fwd.use_fwd_quant",
        "only backward",
    ),
    ("matmul not a mapping", "dlhs: int8\n", "dlhs", "a mapping"),
    ("rules not a list", "rules: {pattern: a}\n", "rules", "a list of rules"),
    ("rule not a mapping", "rules: [int8]\n", "rules[0]", "pattern and config"),
    (
        "invalid regex",
        "rules:\n- {pattern: '(attn', config: int8}\n",
        "rules[0].pattern",
        "a valid regular expression",
    ),
    (
        "regex not a string",
        "rules:\n- {pattern: 12, config: int8}\n",
        "rules[0].pattern",
        "a regular expression",
    ),
    (
        "unknown preset in a rule",
        "rules:\n- {pattern: a, config: int8}\n- {pattern: b, config: int7}\n",
        "rules[1].config",
        "a preset name",
    ),
    (
        "rule without config",
        "rules:\n- {pattern: head}\n",
        "rules[0].config",
        "config: null",
    ),
    (
        "unknown rule key",
        "rules:\n- {pattern: head, config: null, confg: int8}\n",
        "rules[0].confg",
        "pattern, config",
    ),
    ("unknown default preset", "default: int3\n", "default", "a preset name"),
    ("default wrong type", "default: 8\n", "default", "null"),
    ("non-string key", "fwd: {1: 2}\n", "fwd", "string keys"),
    (
        "rule regex that backtracks exponentially",
        "rules:\n- {pattern: '(blocks/\\d+)*/head', config: int8}\n",
        "rules[0].pattern",
        "matches in bounded time",
    ),
    (
        "a constructor's own error",  # numpy's ValueError for this dtype name
        "fwd: {accumulator: '1e-3'}\n",
        "fwd",
        "MatmulConfig(...) raised ValueError",
    ),
]


@pytest.mark.parametrize(
    "text,path,needle", [b[1:] for b in BAD_FILES], ids=[b[0] for b in BAD_FILES]
)
def test_bad_files_raise_config_error_naming_path_value_and_allowed(
    tmp_path, text, path, needle
):
    file = tmp_path / "bad.yaml"
    file.write_text(text)
    with pytest.raises(qbits.ConfigError) as info:
        qbits.load_config(file)
    err = info.value
    assert err.path == path
    assert err.source == os.fspath(file)
    message = str(err)
    assert message.startswith(f"{file}: {path + ': ' if path else ''}expected ")
    assert needle in message


def test_there_are_at_least_twenty_distinct_bad_files():
    assert len({b[1] for b in BAD_FILES}) >= 20


def test_python_tag_never_runs(tmp_path):
    marker = tmp_path / "ran"
    text = f"default: !!python/object/apply:os.system ['touch {marker}']\n"
    with pytest.raises(qbits.ConfigError):
        qbits.load_config(text, None)
    assert not marker.exists()


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(qbits.InvalidArgumentError, match="no such file"):
        qbits.load_config(tmp_path / "missing.yaml")


def test_config_errors_from_python():
    with pytest.raises(qbits.ConfigError, match="int8_fwd"):
        qbits.presets.get("int9")
    with pytest.raises(qbits.ConfigError, match="pattern: expected a valid"):
        qbits.Rule("[", None)
    with pytest.raises(qbits.ConfigError, match=r"rules\[0\]: expected a qbits.Rule"):
        qbits.QuantConfig(rules=("int8",))
    with pytest.raises(qbits.ConfigError, match="default: expected a preset name"):
        qbits.QuantConfig(default=3)
    with pytest.raises(qbits.ConfigError, match=r"fwd\.lhs\.numerics\.bits"):
        qbits.load_config(
            {"fwd": {"lhs": {"numerics": {"type": "int", "bits": 0}}}},
            qbits.DotGeneralConfig,
        )


@pytest.mark.parametrize(
    "args, says",
    [
        ((qbits.MatmulConfig, {"lhs": {}}), "load_config(data, MatmulConfig)"),
        (({"default": "int8"}, "QuantConfig"), "load_config(source, cls)"),
    ],
)
def test_load_config_with_its_arguments_swapped_says_what_to_pass(args, says):
    with pytest.raises(qbits.InvalidArgumentError, match=re.escape(says)):
        qbits.load_config(*args)


@pytest.mark.parametrize(
    "source, says",
    [
        (42, "source=42 is not allowed; expected a qbits.QuantConfig"),
        ("int9", "did you mean 'int8'?"),
        ("rules.txt", "source='rules.txt' is not allowed"),
        ("missing.yaml", "no such file"),
        ("[1, 2]", "the path of a YAML file (*.yaml), YAML text"),
    ],
)
def test_load_config_says_what_it_got_and_what_it_accepts(source, says):
    with pytest.raises(qbits.InvalidArgumentError, match=re.escape(says)) as info:
        qbits.load_config(source)
    assert str(info.value).startswith("qbits.load_config: source=")
    assert "int8_fwd" in str(info.value)  # the preset names are listed


def test_an_op_given_rules_says_it_takes_one_matmuls_config():
    with pytest.raises(qbits.InvalidArgumentError) as info:
        qbits.ops.einsum(qbits.load_config("int8"))
    message = str(info.value)
    assert "expected a qbits.DotGeneralConfig," in message
    assert "QuantConfig" not in message.split("expected")[1].split("(")[0]
    assert "rules (a QuantConfig) are for qbits.quantize" in message


def test_load_config_takes_every_form_of_a_config(tmp_path):
    cfg = qbits.presets.get("w4a8")
    path = tmp_path / "w4a8.yaml"
    text = qbits.config.dump(cfg, path)
    forms = [cfg, "w4a8", path, str(path), text, yaml.safe_load(text)]
    for form in forms:
        assert qbits.load_config(form, qbits.DotGeneralConfig) == cfg
        assert qbits.load_config(form).resolve("any").config == cfg
    assert qbits.load_config(path).source == str(path)
    assert qbits.load_config("w4a8").resolve("any").name == "w4a8"


def test_an_error_raised_because_of_another_reads_flat():
    """The cause on a line of its own, given as the exception or inside the
    text; never one message in another's parentheses."""
    try:
        qbits._granularity.Tiled(tile_size=3).block_sizes((3, 40), (1,))
    except qbits.InvalidArgumentError as e:
        inner = e
    outer = qbits.InvalidArgumentError("me", "config", "cfg", "a fit", why=inner)
    text = f"'fc2' has K = 40: {inner}"
    again = qbits.ConfigError("rules[2].config", "x", "a fit", why=text, layer="fc2")
    assert str(outer) == (
        "me: config='cfg' is not allowed; expected a fit.\n  because: " + str(inner)
    )
    assert str(again).splitlines() == [
        "rules[2].config: expected a fit, got 'x' ('fc2' has K = 40, in layer 'fc2').",
        "  because: " + str(inner),
    ]
    nested = qbits.InvalidArgumentError("top", "a", 1, "b", why=f"{again}")
    assert str(nested).count("because:") == 2 and "((" not in str(nested)


@pytest.mark.parametrize(
    "value, shown",
    [
        (np.zeros((38, 4), np.float16), "float16[38, 4]"),
        ({"params": {"w": jnp.ones((5, 3))}}, "{'params': {'w': float32[5, 3]}}"),
        ("a mapping " + "of many words " * 20 + "of shape [38, 4]", "shape [38, 4]'"),
    ],
)
def test_values_in_errors_keep_their_shape(value, shown):
    text = str(qbits.InvalidArgumentError("me", "x", value, "y"))
    assert shown in text and len(text) < 220


def test_to_dict_rejects_what_it_cannot_write():
    unregistered = qbits.Quantizer(qbits.IntNumerics(bits=8, noise_fn=lambda s, k: 0))
    with pytest.raises(qbits.InvalidArgumentError, match="noise_fn"):
        qc._to_dict(unregistered)
    with pytest.raises(qbits.InvalidArgumentError, match="a qbits config object"):
        qc._to_dict({"fwd": {}})


def test_register_rejects_bad_arguments():
    with pytest.raises(qbits.InvalidArgumentError, match="field"):
        qc.register("numerix", "x", qbits.IntNumerics)
    with pytest.raises(qbits.InvalidArgumentError, match="cls"):
        qc.register("numerics", "x", qbits.AbsMax)
    with pytest.raises(qbits.InvalidArgumentError, match="not taken"):
        qc.register("numerics", "int", qbits.FpNumerics)


# ---------------------------------------------------------------------------
# Bounded reading: a small or hostile file never costs much time or memory.


def _alias_bomb(levels):
    """A "billion laughs" in clip_factors: 9**levels values, a few hundred bytes."""
    lists = ["&l0 [" + ", ".join(["1.0"] * 9) + "]"]
    lists += [
        f"&l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, levels)
    ]
    factors = "".join(f"\n        - {item}" for item in lists)
    return (
        "fwd:\n  rhs:\n    numerics: int\n    calibration:\n      type: mse\n"
        "      clip_factors:" + factors + "\n"
    )


HOSTILE = [
    # (name, file bytes, text of the message)
    ("alias bomb", _alias_bomb(9).encode(), "at most 100000 values in the document"),
    ("alias bomb, small", _alias_bomb(6).encode(), "aliases (*name) expanded"),
    (
        "merge-key chain",
        (
            "m0: &m0 {k: 1}\n"
            + "".join(f"m{i}: &m{i} {{<<: *m{i - 1}, k{i}: 1}}\n" for i in range(1, 40))
        ).encode(),
        "nested at most 32 deep, aliases (*name) expanded",
    ),
    ("deep nesting", b"[" * 20_000, "nested at most 32 deep"),
    ("deep mappings", b"{a: " * 5_000, "nested at most 32 deep"),
    ("too big", b"# padding\n" * 110_000 + b"fwd: {}\n", "at most 1048576 bytes"),
    (
        "long list",
        b"fwd: {rhs: {numerics: int, calibration: {type: mse, clip_factors: ["
        + b"1.0, " * 10_000
        + b"1.0]}}}\n",
        "at most 10000 entries in one list or mapping",
    ),
    ("utf-16", "fwd: {}\n".encode("utf-16"), "UTF-16"),
    ("utf-16 without a mark", "fwd: {}\n".encode("utf-16-le"), "printable"),
    ("latin-1", "rules: []\n# café\n".encode("latin-1"), "line 2, column 6"),
    ("binary", bytes(range(128, 256)), "not UTF-8"),
    ("nul bytes", b"fwd: {}\x00", "printable characters only"),
    ("unhashable key", b"? [a, b]\n: 1\n", "a string, number, bool or null as a key"),
    (
        "integer of 4500 digits",  # Python refuses to read more than 4300
        b"fwd: {rhs: {granularity: {type: tiled, tile_size: -" + b"7" * 4500 + b"}}}",
        "an integer of at most 100 characters",
    ),
]


@pytest.mark.parametrize(
    ("data", "needle"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE]
)
def test_hostile_files_are_refused_quickly_naming_the_file(tmp_path, data, needle):
    file = tmp_path / "bad.yaml"
    file.write_bytes(data)
    start = time.perf_counter()
    with pytest.raises(qbits.ConfigError) as info:
        qbits.load_config(file)
    assert time.perf_counter() - start < 10  # refused, never expanded
    err = info.value
    assert err.source == os.fspath(file)
    assert str(err).startswith(f"{file}: expected ")
    assert needle in str(err)
    assert "\n" not in str(err)


def test_loads_is_bounded_too():
    with pytest.raises(qbits.ConfigError, match="at most 1048576 bytes"):
        qbits.load_config("# x\n" * 300_000, None)
    with pytest.raises(qbits.ConfigError, match="nested at most 32 deep"):
        qbits.load_config("[" * 20_000, None)
    with pytest.raises(qbits.ConfigError, match="expected UTF-8 text"):
        qbits.load_config("fwd: {}".encode("utf-16"), None)


def test_limits_leave_room_for_real_files(tmp_path):
    """A UTF-8 byte-order mark, anchors reused a few times, a long rule list."""
    text = "rules:\n" + "".join(
        f"  - {{pattern: 'layer{i}', config: *q}}\n" for i in range(1, 2000)
    )
    text = (
        "\ufeffrules:\n  - pattern: layer0\n    config: &q\n      fwd:\n"
        "        lhs: &i8 {numerics: {type: int, bits: 8}}\n        rhs: *i8\n"
        + text.removeprefix("rules:\n")
    )
    file = tmp_path / "ok.yaml"
    file.write_bytes(text.encode("utf-8"))
    config = qbits.load_config(file)
    assert len(config.rules) == 2000
    assert config.rules[1999].config.fwd.rhs.numerics.bits == 8
    assert config.rules[0].config == config.rules[1999].config


def test_read_yaml_is_plain_data_with_the_same_rules(tmp_path):
    file = tmp_path / "s.yaml"
    file.write_text("seeds: [0, 1]\nseeds: [2]\n")
    with pytest.raises(qbits.ConfigError, match="duplicate key at line 2"):
        qc._read_yaml(file)
    file.write_text("a: &x [1, 2]\nb: *x\n")
    assert qc._read_yaml(file) == {"a": [1, 2], "b": [1, 2]}


def test_layer_is_a_field_of_config_errors():
    e = qbits.ConfigError(
        "fwd.rhs.x", 3, "an int", why="operand shape (2, 3)", layer="blocks/0/mlp"
    )
    located = e.within("rules[1].config", "f")
    assert located.layer == "blocks/0/mlp"
    assert str(located) == (
        "f: rules[1].config.fwd.rhs.x: expected an int, got 3 "
        "(operand shape (2, 3), in layer 'blocks/0/mlp')."
    )
    top = qbits.ConfigError("x", 3, "an int", layer="")
    assert str(top).endswith("in layer '' (the top-level module)).")


def test_exponent_notation_without_a_dot_is_a_number():
    # YAML 1.1 read 5E-1 or 2.5e0 as strings ("expected a finite number, got
    # '5E-1'"); YAML 1.2 and JSON read them as numbers, and so does qbits.
    text = """\
fwd:
  rhs:
    numerics: int
    calibration: {type: mse, clip_factors: [5E-1, 2.5e0, +7.5e-1]}
  lhs: {numerics: int, calibration: {type: constant, value: 3e2}}
"""
    cfg = qbits.load_config(text, None)
    assert cfg.fwd.rhs.calibration.clip_factors == (0.5, 2.5, 0.75)
    assert cfg.fwd.lhs.calibration.value == 300.0
    assert qbits.load_config(qc.dump(cfg), None) == cfg
    # Words and version-like strings stay strings; a string that looks like
    # such a number is quoted when written.
    assert qc._yamlio.parse_yaml("a: [e3, 1e, 1.2.3, 3e2x]") == {
        "a": ["e3", "1e", "1.2.3", "3e2x"]
    }
    rules = qbits.QuantConfig(rules=(qbits.Rule("1e3", None),))
    assert "'1e3'" in qc.dump(rules)
    assert qbits.load_config(qc.dump(rules), None) == rules


def test_a_fifo_is_refused_not_waited_for(tmp_path):
    # Opening a FIFO for reading waits for a writer: load_config hung forever.
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    errors = []

    def writer():  # gives a reader that waits what it waits for
        try:
            with open(fifo, "w") as f:
                f.write("default: int8\n")
        except OSError as e:  # the reader went away
            errors.append(e)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        with pytest.raises(qbits.ConfigError) as info:
            qbits.load_config(fifo)
    finally:
        release = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        thread.join()
        os.close(release)
    message = str(info.value)
    assert message.startswith(f"{fifo}: expected a regular file, got ")
    assert message.endswith(
        "(it is a FIFO (named pipe); a config is read from a file)."
    )


def test_constructor_errors_become_config_errors_naming_the_place():
    # float(10**400) overflows: the bound checks raised OverflowError.
    data = {
        "fwd": {
            "rhs": {
                "numerics": "int",
                "calibration": {"type": "absmax", "clip_factor": 10**400},
            }
        }
    }
    with pytest.raises(qbits.ConfigError) as info:
        qbits.load_config(data, qbits.DotGeneralConfig)
    assert info.value.path == "fwd.rhs.calibration.clip_factor"
    assert "a finite number" in str(info.value)
