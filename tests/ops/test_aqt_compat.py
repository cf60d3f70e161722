"""Users moving off AQT get the same int8 forward numbers."""

import pathlib

import jax
import numpy as np

import qbits

GOLDEN = pathlib.Path(__file__).parents[1] / "data" / "aqt_int8_forward.npz"


def test_int8_forward_equals_aqt_v2_bit_for_bit():
    # AQT v2's int8 (IntNumerics preserve_zero=True, preserve_max_val=False,
    # absmax shared along the contracting axes); made by make_aqt_golden.py.
    data = np.load(GOLDEN)
    int8 = qbits.Quantizer(qbits.IntNumerics(bits=8), granularity=qbits.PerChannel())
    dg = qbits.dot_general(
        qbits.DotGeneralConfig(fwd=qbits.MatmulConfig(lhs=int8, rhs=int8))
    )
    for i in range(2):
        out = jax.jit(dg, static_argnums=2)(
            data[f"x{i}"], data[f"w{i}"], (((1,), (0,)), ((), ()))
        )
        np.testing.assert_array_equal(np.asarray(out), data[f"out{i}"])
