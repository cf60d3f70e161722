"""qbits.hlo.dot_dtypes: the dots of a function, compiled or as its jaxpr."""

import jax
import jax.numpy as jnp
import pytest

import qbits
import qbits.hlo

DN = (((1,), (0,)), ((), ()))


def test_one_function_reads_the_jaxpr_and_the_compiled_module():
    dg = qbits.dot_general(qbits.presets.get("int8_fwd"))
    x, w = jnp.ones((4, 8)), jnp.ones((8, 3))

    def f(x, w):
        return dg(x, w, DN)

    # What qbits emitted, and what XLA:CPU runs of it (natively s8).
    assert qbits.hlo.dot_dtypes(f, x, w, stage="jaxpr") == [("int8", "int8", "int32")]
    assert qbits.hlo.dot_dtypes(f, x, w) == [("s8", "s8", "s32")]
    text = jax.jit(f).lower(x, w).compile().as_text()
    assert qbits.hlo.dot_dtypes(text) == [("s8", "s8", "s32")]
    with pytest.raises(qbits.InvalidArgumentError, match="stage"):
        qbits.hlo.dot_dtypes(f, x, w, stage="hlo")
    with pytest.raises(qbits.InvalidArgumentError, match="traces f"):
        qbits.hlo.dot_dtypes(text, stage="jaxpr")
    with pytest.raises(qbits.InvalidArgumentError, match="primitive"):
        qbits.hlo.dot_dtypes(f, x, w, primitive="conv_general_dilated")
