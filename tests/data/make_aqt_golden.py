"""How tests/data/aqt_int8_forward.npz was made (needs `pip install aqtp`).

AQT v2's int8 config (fully_quantized, forward only, no stochastic rounding)
on fixed inputs; test_aqt_compat.py checks that qbits' AQT-style int8 gives
the same forward numbers. Not run by the test suite (aqtp is end-of-life and
not a dependency).
"""

import jax
import numpy as np
from aqt.jax.v2 import config as aqt_config

rng = np.random.default_rng(20261121)
cases = {}
for i, (m, k, n) in enumerate([(16, 64, 32), (8, 256, 48)]):
    x = (rng.standard_normal((m, k)) * 3).astype(np.float32)
    w = (rng.standard_normal((k, n)) / 10).astype(np.float32)
    dot = aqt_config.fully_quantized(
        fwd_bits=8, bwd_bits=None, use_stochastic_rounding=False
    )
    out = jax.jit(lambda a, b, dot=dot: dot(a, b, (((1,), (0,)), ((), ()))))(x, w)
    cases.update({f"x{i}": x, f"w{i}": w, f"out{i}": np.asarray(out)})
np.savez_compressed("tests/data/aqt_int8_forward.npz", **cases)
