"""Double-quantized scales (QLoRA's NF4 storage): qbits._quantizer._double."""

import json
import pathlib

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qbits
from qbits._quantizer._double import double_quantize
from qbits._tensor import decode_scale, float_scale
from qbits.interop._safetensors import read_tensors
from qbits.numerics import Nf4Numerics
from qbits.numerics._dynamic import SIGNED_MAP

DATA = pathlib.Path(__file__).parent / "data" / "quantized"
MODULES = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj")
# The widest gap between neighbouring levels of the signed map (0.1 .. 1 in
# steps of 0.9 / 64): a scale's code is off by at most half of it, times its
# nested block's absmax.
HALF_GAP = float(np.max(np.diff(SIGNED_MAP))) / 2
_dq = jax.jit(double_quantize)


def _nf4(tile: int, double: bool) -> qbits.Quantizer:
    return qbits.Quantizer(
        Nf4Numerics(), qbits.AbsMax(), qbits.Tiled(tile_size=tile), double_quant=double
    )


def test_the_weights_bitsandbytes_quantized_give_its_file():
    # bnb_nf4 and bnb_nf4_dq: the same float32 weights, blocks of 32, without
    # and with double quantization. qbits' double quantization of the
    # weights bnb_nf4 stores gives bnb_nf4_dq's codes bit for bit.
    single, double = read_tensors(DATA / "bnb_nf4"), read_tensors(DATA / "bnb_nf4_dq")
    ref, ref_dq = (
        np.load(DATA / n / "reference.npz") for n in ("bnb_nf4", "bnb_nf4_dq")
    )
    quant = jax.jit(
        lambda w: _nf4(32, True).quant(w, store=True, contracting_axes=(0,))
    )
    for m in MODULES:
        w = ref[f"weight/{m}"].T  # [in, out]: levels x absmax, on the grid
        qt = quant(w)
        packed = single[f"{m}.weight"][:, 0]
        nibbles = np.stack([packed >> 4, packed & 15], -1).reshape(w.shape[::-1]).T
        np.testing.assert_array_equal(np.asarray(qt.qvalue).astype(np.uint8), nibbles)
        assert qt.scale.dtype == jnp.uint8 and qt.scale.shape == (w.shape[0] // 32, 32)
        codes = np.asarray(qt.scale).T.ravel()  # bitsandbytes' order: [out, in // 32]
        np.testing.assert_array_equal(codes, double[f"{m}.weight.absmax"])
        # The offset is the mean of the absmax; PyTorch sums in another
        # order: one rounding apart at most (o_proj's is, q_proj's not).
        state = bytes(double[f"{m}.weight.quant_state.bitsandbytes__nf4"])
        offset = np.float32(json.loads(state)["nested_offset"])
        assert abs(float(qt.scale_offset[0, 0]) - offset) <= np.spacing(offset)
        nested = double[f"{m}.weight.nested_absmax"]
        # max |absmax - offset|: moved by the offset's rounding
        assert np.all(np.abs(qt.scale_absmax - nested) <= np.spacing(offset))
        # With the file's offset and absmax, bitsandbytes' weights bit for bit.
        own = qt.replace(
            scale_absmax=jnp.asarray(nested), scale_offset=jnp.full((1, 1), offset)
        )
        np.testing.assert_array_equal(
            np.asarray(own.dequant()).T, ref_dq[f"weight/{m}"]
        )


def test_qlora_double_quant_round_trip_and_its_bytes():
    # nf4_dq against nf4: the same 4-bit codes; each weight is its level
    # times the decoded scale, off the float32 scale by at most half the map's
    # widest gap times its nested block's absmax (and float32 roundings).
    k = jax.random.split(jax.random.key(0), 2)
    w = jax.random.normal(k[0], (64 * 5, 208)) * jnp.linspace(0.01, 2.0, 208)
    cfg, cfg1 = (qbits.presets.get(p).fwd for p in ("nf4_dq", "nf4"))

    @jax.jit
    def both(w):
        stored = qbits.ops._store_weight(w, cfg, (0,))
        single = qbits.ops._store_weight(w, cfg1, (0,))
        fake = cfg.rhs.quant(w, contracting_axes=(0,)).dequant()  # not stored
        return (
            stored,
            single,
            stored.dequant(),
            single.dequant(),
            float_scale(stored),
            fake,
        )

    stored, single, wq, w1, s_hat, fake = both(w)
    assert pytest.approx(0.0140625 / 2, rel=1e-5) == HALF_GAP
    np.testing.assert_array_equal(stored.qvalue, single.qvalue)
    np.testing.assert_array_equal(fake, wq)  # train = serve
    n = 5 * 208  # scales: 5 blocks of 64 per column; 4 nested blocks of 256 + 16
    assert stored.scale.shape == (5, 208) and stored.scale_absmax.shape == (5,)
    assert stored.nbytes == w.size // 2 + n + 4 * 5 + 4
    assert single.nbytes == w.size // 2 + 4 * n
    assert 8 * stored.nbytes / w.size == pytest.approx(4.127, abs=1e-3)
    s = np.asarray(single.scale)
    nested = np.repeat(np.asarray(stored.scale_absmax), 256)[:n].reshape(208, 5).T
    err = np.abs(np.asarray(s_hat) - s)
    assert np.all(err <= HALF_GAP * nested + 2**-22 * np.abs(s).max())
    assert err.max() > 0.5 * HALF_GAP * nested.min()  # the bound is near tight
    # |level q| |s_hat - s|, and each product's rounding
    wq, w1 = np.asarray(wq), np.asarray(w1)
    level = np.abs(
        np.asarray(Nf4Numerics().levels, np.float32)[stored.unpack().qvalue.astype(int)]
    )
    bound = level * np.repeat(err, 64, axis=0) + 2**-24 * (np.abs(wq) + np.abs(w1))
    assert np.all(np.abs(wq - w1) <= bound)


@settings(max_examples=40, deadline=None)
@given(
    hnp.arrays(
        np.float32,
        (3, 100),
        elements=st.floats(-1e4, 1e4, width=32, allow_subnormal=False),
    )
)
def test_scales_go_to_the_nearest_level_of_the_dynamic_map(s):
    # 300 scales: one full nested block of 256 (times 1 / absmax), then a
    # partial one of 44 (divided by its absmax), in the order of the axes
    # reversed; a tie goes to the lower level.
    codes, absmax, offset = (np.asarray(a) for a in _dq(jnp.asarray(s)))
    assert codes.dtype == np.uint8 and codes.shape == s.shape
    o = offset.reshape(())
    assert o == np.float32(jnp.mean(s))
    x = s.T.ravel() - o
    tiny = np.finfo(np.float32).tiny  # bitsandbytes' 1e-38 is subnormal
    a = np.array([np.abs(x[:256]).max(), max(np.abs(x[256:]).max(), tiny)], np.float32)
    np.testing.assert_array_equal(absmax, a)
    full = x[:256] * (np.float32(1) / np.maximum(a[0], tiny))
    y = np.clip(np.concatenate([full, x[256:] / a[1]]), -1, 1)
    dist = np.abs(y[:, None] - SIGNED_MAP[None, :])
    c = codes.T.ravel()
    np.testing.assert_array_equal(dist[np.arange(300), c], dist.min(1))
    assert np.all(c == dist.argmin(1))  # the first (lower) of equal distances
    decoded = np.asarray(
        decode_scale(jnp.asarray(codes), jnp.asarray(absmax), jnp.asarray(offset))
    )
    want = SIGNED_MAP[c] * np.repeat(a, 256)[:300] + o
    np.testing.assert_array_equal(decoded.T.ravel(), want)


def test_bad_double_quant_settings_and_arrays():
    nf4 = Nf4Numerics()
    with pytest.raises(qbits.InvalidArgumentError, match="double_quant"):
        qbits.Quantizer(nf4, double_quant=1)
    for numerics, rounding in (
        (qbits.numerics.UintNumerics(bits=4), "none"),  # a zero point
        (nf4, "e4m3"),  # NVFP4's two-level scales
        (nf4, "pow2"),
    ):
        with pytest.raises(qbits.InvalidArgumentError, match="double_quant=True"):
            qbits.Quantizer(numerics, scale_rounding=rounding, double_quant=True)
    codes = jnp.zeros((4, 3), jnp.uint8)
    absmax, offset = jnp.ones((1,)), jnp.zeros((1, 1))
    for args in (
        (codes.astype(jnp.int8), absmax, offset),  # not uint8
        (codes, jnp.ones((2,)), offset),  # 12 scales: one nested block
        (codes, absmax, jnp.zeros((1,))),  # the offset's rank
    ):
        with pytest.raises(qbits.InvalidArgumentError, match="scale_absmax"):
            decode_scale(*args)


def test_ptq_refuses_double_quant_by_name():
    # GPTQ's codes are chosen for the float32 scales it computes: storing
    # them double-quantized would serve other weights than it reports.
    import qbits.ptq

    params = {"w": jnp.ones((64, 8))}
    with pytest.raises(qbits.InvalidArgumentError, match="double_quant=True for 'w'"):
        qbits.ptq.quantize_weights(
            lambda p, x: x @ p["w"], params, [jnp.ones((2, 64))], "nf4_dq"
        )
