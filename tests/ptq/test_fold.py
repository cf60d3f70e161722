"""quantize_weights(method=Awq(), fold=...): AWQ's scales folded into the layer
before, its weights on their grids and stored (qbits/ptq/_fold.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qbits
from qbits import ptq
from qbits.numerics import IntNumerics

K, N = 16, 8


def _net(p, x):
    # a norm's scale before two matmuls; a's output channels before c
    h = x * p["norm"]["g"]
    a = h @ p["a"]["kernel"] + p["a"]["bias"]
    return jnp.tanh(h @ p["b"]["kernel"]) + a @ p["c"]["kernel"]


def _params():
    k = jax.random.split(jax.random.key(0), 5)
    return {
        "norm": {"g": 1.0 + 0.1 * jax.random.normal(k[0], (K,))},
        "a": {
            "kernel": jax.random.normal(k[1], (K, K)),
            "bias": jax.random.normal(k[2], (K,)),
        },
        "b": {"kernel": jax.random.normal(k[3], (K, N))},
        "c": {"kernel": jax.random.normal(k[4], (K, N))},
    }


def _x():
    x = jax.random.normal(jax.random.key(1), (64, K))
    return x * jnp.where(jnp.arange(K) < 2, 20.0, 1.0)  # two salient channels


FOLD = {"a": ("c",), "norm": ("a", "b")}  # a's columns first, then a itself


def _config(bits, granularity):
    q = qbits.Quantizer(IntNumerics(bits=bits), qbits.AbsMax(), granularity)
    return qbits.DotGeneralConfig(fwd=qbits.MatmulConfig(rhs=q))


def test_fold_keeps_the_function_and_stores_every_weight_on_its_grid():
    params, x = _params(), _x()
    want = _net(params, x)
    # 16 bits: Q(s w) is s w to ~1e-5, so the folded model is the float one
    fine = ptq.quantize_weights(_net, params, [x], _config(16, qbits.PerChannel()),
                                method=ptq.Awq(grid=5), fold=FOLD)  # fmt: skip
    top = float(jnp.abs(want).max())
    np.testing.assert_allclose(_net(fine.params, x), want, rtol=0, atol=1e-4 * top)
    # the folded norm is g / s: s has the salient channels scaled up
    s = params["norm"]["g"] / fine.params["norm"]["g"]
    assert float(s[:2].min()) > float(s[2:].max())

    config = _config(4, qbits.Tiled(tile_size=8))
    awq = ptq.Awq(grid=5, clip_grid=3)
    out = ptq.quantize_weights(_net, params, [x], config, method=awq, fold=FOLD)
    assert [r.path for r in out.layers] == ["a", "b", "c"]  # the stats' order
    # per layer before, never worse than RTN (alpha = 0 is s = 1): a and b
    # summed (one s for both), c alone
    err = {r.path: (r.error, r.error_rtn) for r in out.layers}
    assert err["a"][0] + err["b"][0] <= err["a"][1] + err["b"][1]
    assert err["c"][0] <= err["c"][1]
    assert sorted(out.stored) == ["a", "b", "c"]
    for m in "abc":  # the weight in params is the stored one, bit for bit
        np.testing.assert_array_equal(out.stored[m].dequant(), out.params[m]["kernel"])
    # served from the stored codes: the float function of the folded params
    sp = qbits.serving.convert(_net, config, out, x)
    got = qbits.serving.serve(_net, config)(sp, x)
    np.testing.assert_allclose(got, _net(out.params, x), rtol=1e-5, atol=1e-4)

    # one matmul under its layer (the norm's output b's alone): the s of
    # Awq's own search
    def net(p, x):
        h = x * p["norm"]["g"]
        a = x @ p["a"]["kernel"] + p["a"]["bias"]
        return jnp.tanh(h @ p["b"]["kernel"]) + a @ p["c"]["kernel"]

    one = ptq.quantize_weights(net, params, [x], config,
                               method=ptq.Awq(grid=5, clip_grid=1),
                               fold={"norm": ("b",)})  # fmt: skip
    stats = ptq.collect_stats(net, params, [x], config=config)["b"].stats
    quantizer = config.fwd.rhs
    mine = ptq.Awq(grid=5, clip_grid=1).search(params["b"]["kernel"], stats, quantizer)
    s = params["norm"]["g"] / one.params["norm"]["g"]
    np.testing.assert_allclose(s, mine.scales, rtol=1e-6)
    # "a" in no entry: s = 1, RTN's grid with AWQ's clipping search off
    rtn = ptq.quantize_weights(net, params, [x], config, method="rtn")
    np.testing.assert_array_equal(one.params["a"]["kernel"], rtn.params["a"]["kernel"])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"fold": {"norm": ("a", "zz")}},
            r"'zz'.*paths of weight matmuls the config quantizes: a, b, c",
        ),
        ({"fold": {"norm": ("a",), "a": ("c",)}}, r"'a' listed before 'norm'"),
        ({"fold": {"norm": ("a",), "q": ("c",)}}, r"no parameter is under 'q'"),
        ({"fold": {"norm": ("a", "c")}}, r"'a' and 'c' read other inputs"),
        ({"fold": {"norm": ("a",), "c": ("b",)}}, r"'c/kernel' has shape \[16, 8\]"),
        ({"fold": {"norm": ("a",)}, "method": "gptq"}, r"only AWQ has scales"),
        # b reads the norm's output too: dividing it would change b's input
        (
            {"fold": {"norm": ("a",)}, "method": ptq.Awq(grid=5, clip_grid=1)},
            r"folded differs from the model by",
        ),
        ({"fold": {"norm": "a"}}, r"a mapping \{layer before"),
        ({"fold": {"t": ("c",)}, "net": "t"}, r"'t' reads 't/kernel' with its output"),
    ],
)
def test_bad_folds_raise(kwargs, match):
    kwargs = {"method": ptq.Awq(grid=2, clip_grid=1), **kwargs}
    net, params = _net, _params()
    if kwargs.pop("net", None):  # t's kernel stored [out, in], read transposed
        params = {**params, "t": {"kernel": params["a"]["kernel"]}}

        def net(p, x):
            return _net(p, x @ p["t"]["kernel"].T)

    with pytest.raises(qbits.InvalidArgumentError, match=match):
        ptq.quantize_weights(net, params, [_x()], _config(8, qbits.PerChannel()),
                             **kwargs)  # fmt: skip


def test_a_bfloat16_model_folds():
    # the folded layers and s w rounded to bfloat16 move the float model by
    # about 1e-2 of its largest output: a fold that is right is not refused
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), _params())
    x = _x().astype(jnp.bfloat16)
    config, awq = _config(8, qbits.PerChannel()), ptq.Awq(grid=5, clip_grid=1)
    out = ptq.quantize_weights(_net, params, [x], config, method=awq, fold=FOLD)
    assert sorted(out.stored) == ["a", "b", "c"]
    assert out.params["norm"]["g"].dtype == jnp.bfloat16
