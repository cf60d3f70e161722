"""The PTQ formats in YAML: round trips and bad values."""

import pytest

import qbits
from qbits import config as qc
from qbits.numerics import Nf4Numerics, UintNumerics

E2M1 = qbits.FpNumerics("float4_e2m1fn")


@pytest.mark.parametrize(
    "quantizer",
    [
        qbits.Quantizer(UintNumerics(bits=3, clip_gradient=True), qbits.MseSearch()),
        qbits.Quantizer(
            UintNumerics(bits=8), qbits.AbsMax(0.9), qbits.PerChannel(), "none"
        ),
        qbits.Quantizer(Nf4Numerics(clip_gradient=True), granularity=qbits.Tiled()),
        qbits.Quantizer(
            E2M1, granularity=qbits.Tiled(tile_size=16), scale_rounding="e4m3"
        ),
        qbits.Quantizer(qbits.IntNumerics(bits=4), scale_rounding="e4m3"),
    ],
)
def test_new_configs_round_trip_through_yaml(quantizer):
    cfg = qbits.DotGeneralConfig(fwd=qbits.MatmulConfig(lhs=quantizer, rhs=quantizer))
    assert qbits.load_config(qc.dump(cfg), None) == cfg
    assert qbits.load_config(qc._to_dict(cfg), qbits.DotGeneralConfig) == cfg


def test_the_yaml_of_the_new_formats_reads_as_written():
    cfg = qbits.load_config(
        "fwd:\n"
        "  lhs: {numerics: {type: fp, dtype: float4_e2m1fn}, scale_rounding: e4m3,\n"
        "        granularity: {type: tiled, tile_size: 16}}\n"
        "  rhs: {numerics: {type: uint, bits: 4}, calibration: mse,\n"
        "        granularity: {type: tiled, tile_size: 128}}\n",
        None,
    )
    assert cfg.fwd.lhs == qbits.presets.get("nvfp4").fwd.lhs
    w4g128_asym = qbits.presets.get("w4g128_asym").fwd.rhs
    assert cfg.fwd.rhs == w4g128_asym.replace(calibration=qbits.MseSearch())
    assert qbits.load_config("fwd: {rhs: {numerics: nf4, granularity: {type: tiled, "
                    "tile_size: 64}}}", None) == qbits.presets.get("nf4")  # fmt: skip


@pytest.mark.parametrize(
    ("text", "where", "allowed"),
    [
        ("{type: uint, bits: 12}", "fwd.rhs.numerics.bits", "an int in 1..8"),
        ("{type: uint, bits: 4, dtype: int4}", "fwd.rhs.numerics.dtype", "unsigned"),
        ("{type: nf4, bits: 4}", "fwd.rhs.numerics.bits", "clip_gradient"),
    ],
)
def test_bad_values_name_their_path(text, where, allowed):
    with pytest.raises(qbits.ConfigError, match=rf"{where}.*{allowed}"):
        qbits.load_config(f"fwd: {{rhs: {{numerics: {text}}}}}\n", None)
    with pytest.raises(qbits.ConfigError, match=r"fwd\.rhs\.scale_rounding.*e4m3"):
        qbits.load_config(
            "fwd: {rhs: {numerics: {type: int, bits: 4}, scale_rounding: e5m2}}", None
        )
    with pytest.raises(qbits.ConfigError, match=r"fwd\.rhs\.provider.*zero point"):
        qbits.load_config(
            "fwd: {rhs: {numerics: {type: uint, bits: 4}, provider: delayed}}", None
        )
