"""qbits.ptq: GPTQ, AWQ, SmoothQuant and rotations against NumPy references.

Small shapes, one compile per GPTQ configuration: the references are
straight NumPy transcriptions of the papers' algorithms.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qbits
from qbits import ptq

INT4_MAX = 7  # IntNumerics(bits=4): grid -7..7, the bound on 7.5 (edge)


def _gptq(w, h, quantizer, **settings):
    """GPTQ of one weight through its method value (only H matters)."""
    ones = jnp.ones(len(h), jnp.float32)
    stats = ptq.InputStats(h, ones, ones, jnp.float32(1))
    return ptq.Gptq(**settings).quantize(w, stats, quantizer)


def _awq(w, h, absmean, quantizer, **settings):
    """AWQ's search on one weight through its method value."""
    absmean = jnp.asarray(absmean)  # abssum over one row
    stats = ptq.InputStats(h, absmean, absmean, jnp.float32(1))
    return ptq.Awq(**settings).search(w, stats, quantizer)


def _np_scale(block, bits=4):
    """qbits' AbsMax scale per column of ``block`` (1 for a zero column)."""
    m = np.abs(block).max(axis=0)
    return np.where(m == 0, 1.0, m / (2 ** (bits - 1) - 0.5))


def _np_quant(w, s, bits=4):
    top = 2 ** (bits - 1) - 1
    return np.clip(np.round(w / s), -top, top) * s


def _np_gptq(w, h, group, act_order, damping=0.01):
    """GPTQ row by row (no lazy batches), in float64."""
    w, h = w.copy(), h.copy()
    k = w.shape[0]
    dead = np.diag(h) == 0
    h[dead, dead] = 1
    w[dead] = 0
    if act_order:
        static = [_np_scale(w[i : i + group]) for i in range(0, k, group)]
        perm = np.argsort(-np.diag(h), kind="stable")
        w, h = w[perm], h[perm][:, perm]
    h += damping * np.mean(np.diag(h)) * np.eye(k)
    u = np.linalg.cholesky(np.linalg.inv(h)).T
    q = np.zeros_like(w)
    for i in range(k):
        if act_order:
            s = static[perm[i] // group]
        elif i % group == 0:
            s = _np_scale(w[i : i + group])
        q[i] = _np_quant(w[i], s)
        w[i:] -= np.outer(u[i, i:], (w[i] - q[i]) / u[i, i])
    return q[np.argsort(perm)] if act_order else q


def _calibration(seed, k=32, n=8, rows=128, dead=None):
    """Correlated inputs (one dead channel), a weight, ``H = X^T X``."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k)) @ rng.standard_normal((k, k))
    x *= rng.uniform(0.2, 3.0, k)
    if dead is not None:
        x[:, dead] = 0
    w = rng.standard_normal((k, n))
    return x, w, x.T @ x


def _int4(granularity):
    return qbits.Quantizer(qbits.IntNumerics(bits=4), granularity=granularity)


# --- GPTQ --------------------------------------------------------------------


def _np_error(w, w_hat, h):
    d = w - w_hat
    return np.sum(d * (h @ d))


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("group", [32, 8], ids=["per_channel", "group8"])
def test_gptq_equals_the_reference_and_beats_round_to_nearest(group, act_order):
    granularity = qbits.PerChannel() if group == 32 else qbits.Tiled(tile_size=group)
    quantizer = _int4(granularity)
    with jax.enable_x64(True):
        for seed in range(3):
            _, w, h = _calibration(seed, dead=5)
            # blocks of 16 rows: lazy batch updates across 2 blocks, groups of
            # 8 inside a block and the single group across them.
            out = _gptq(w, h, quantizer, act_order=act_order, block_size=16)
            want = _np_gptq(w, h, group, act_order)
            assert out.weight.dtype == np.float64
            assert out.scale.shape == (32 // group, 8)
            np.testing.assert_allclose(out.weight, want, rtol=0, atol=1e-5)
            assert not np.asarray(out.weight)[5].any()  # the dead input
            # The weight is on the grid of the scales it returns.
            scale = np.repeat(np.asarray(out.scale), group, axis=0)
            codes = np.asarray(out.weight) / scale
            np.testing.assert_allclose(codes, np.round(codes), atol=1e-4)
            assert np.abs(codes).max() <= INT4_MAX + 1e-4
            rtn = np.concatenate(
                [_np_quant(b, _np_scale(b)) for b in np.split(w, 32 // group)]
            )
            assert _np_error(w, out.weight, h) < 0.8 * _np_error(w, rtn, h), seed
        if group == 8 and act_order:  # not positive definite (no new compile)
            with pytest.raises(qbits.InvalidArgumentError, match=r"this layer.*damp"):
                _gptq(w, -h, quantizer, act_order=True, block_size=16)
            # Damping 1 already: no larger damping to advise, only the Hessian.
            with pytest.raises(qbits.InvalidArgumentError) as e:
                _gptq(w, -h, quantizer, act_order=True, block_size=16, damping=1.0)
            assert "larger damping" not in str(e.value)
            assert "X^T X" in str(e.value)


E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


@pytest.mark.parametrize("fmt", ["uint4_g8", "nvfp4"])
def test_gptq_rounds_every_row_onto_its_groups_zero_points_and_two_level_scales(fmt):
    """Formats whose blocks carry more than a scale keep each group's numbers.

    (Their rows were once re-calibrated one by one: off the grid, "exact".)
    """
    _, w, h = _calibration(1)
    w = w.astype(np.float32)
    if fmt == "nvfp4":
        quantizer = qbits.presets.get("nvfp4_weight_only").fwd.rhs  # blocks of 16
    else:
        quantizer = qbits.Quantizer(
            qbits.numerics.UintNumerics(bits=4), granularity=qbits.Tiled(tile_size=8)
        )
    out = _gptq(w, h, quantizer)
    rtn = jax.jit(lambda w: quantizer.quant(w, contracting_axes=(0,)))(jnp.asarray(w))
    group = quantizer.granularity.tile_size
    scale = np.repeat(np.asarray(out.scale), group, axis=0)
    weight = np.asarray(out.weight)
    if fmt == "nvfp4":
        assert out.zero_point is None
        assert out.tensor_scale == rtn.tensor_scale.reshape(())  # from all of w
        b = np.asarray(out.scale)
        np.testing.assert_array_equal(b, b.astype(qbits.numerics.FpNumerics(
            "float8_e4m3fn").get_dtype()).astype(np.float32))  # fmt: skip
        codes = np.abs(weight / (scale * float(out.tensor_scale)))
        assert np.isin(np.round(codes, 5), E2M1).all()
    else:
        assert out.tensor_scale is None
        codes = weight / scale + np.repeat(np.asarray(out.zero_point), group, axis=0)
        np.testing.assert_allclose(codes, np.round(codes), atol=1e-3)
        assert codes.min() > -1e-3 and codes.max() < 15 + 1e-3
    rtn = np.asarray(jax.jit(lambda q: q.dequant())(rtn))
    assert _np_error(w, weight, h) < 0.8 * _np_error(w, rtn, h)


def test_gptq_bad_arguments_raise():
    _, w, h = _calibration(0)
    with pytest.raises(qbits.InvalidArgumentError, match="tile_size=12"):
        _gptq(w, h, _int4(qbits.Tiled(tile_size=12)))  # does not divide 32
    with pytest.raises(qbits.InvalidArgumentError, match="hessian"):
        _gptq(w, h[:8], _int4(qbits.PerChannel()))
    with pytest.raises(qbits.InvalidArgumentError, match=r"w\.shape"):
        _gptq(w[0], h, _int4(qbits.PerChannel()))
    delayed = qbits.Quantizer(qbits.IntNumerics(4), provider=qbits.DelayedScaling())
    with pytest.raises(qbits.InvalidArgumentError, match="provider"):
        _gptq(w, h, delayed)
    noisy = qbits.Quantizer(
        qbits.IntNumerics(4, noise_fn=qbits.numerics.UniformNoise()),
        granularity=qbits.PerChannel(),
    )
    with pytest.raises(qbits.InvalidArgumentError, match="noise_fn"):
        _gptq(w, h, noisy)
    with pytest.raises(qbits.InvalidArgumentError, match="damping"):
        _gptq(w, h, _int4(qbits.PerChannel()), damping=-1.0)
    # NaN or inf is named as such, never as a damping too small.
    h_nan, w_inf = h.copy(), w.copy()
    h_nan[4, 7] = np.nan
    w_inf[2, 1] = -np.inf
    for args, argument in (((w, h_nan), "hessian"), ((w_inf, h), "w")):
        with pytest.raises(qbits.InvalidArgumentError) as e:
            _gptq(*args, _int4(qbits.PerChannel()))
        assert str(e.value).startswith(f"gptq: {argument}='an array with 1 NaN")
        assert "damping" not in str(e.value)


# --- AWQ ---------------------------------------------------------------------


def test_awq_picks_the_best_alpha_of_the_grid():
    rng = np.random.default_rng(0)
    k, n, grid = 16, 8, 11
    x = rng.standard_normal((256, k)) * np.where(np.arange(k) < 3, 10.0, 1.0)
    x, w = x.astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    h, m = x.T @ x, np.abs(x).mean(0)
    quantizer = _int4(qbits.PerChannel())
    out = _awq(w, h, m, quantizer, grid=grid, clip_grid=1)  # scales alone

    def reference(alpha):  # brute force, in float64, through the activations
        s = np.maximum(m.astype(np.float64) ** alpha, 1e-4)
        s /= np.sqrt(s.max() * s.min())
        sw = s[:, None] * w
        eff = _np_quant(sw, _np_scale(sw)) / s[:, None]
        return np.sum((x @ w - x @ eff) ** 2), s, eff

    errors = [reference(a)[0] for a in np.linspace(0, 1, grid)]
    best = int(np.argmin(errors))
    assert float(out.alpha) == pytest.approx(best / (grid - 1))
    np.testing.assert_allclose(out.error, errors[best], rtol=1e-3)
    _, s, eff = reference(best / (grid - 1))
    np.testing.assert_allclose(out.scales, s, rtol=1e-5)
    np.testing.assert_allclose(out.weight, eff, rtol=1e-4, atol=1e-5)
    # alpha = 0 is round-to-nearest: AWQ is never worse, here much better.
    assert out.error <= errors[0] * (1 + 1e-5) and errors[best] < 0.9 * errors[0]


def test_awq_clip_search_picks_each_blocks_best_ratio():
    rng = np.random.default_rng(1)
    k, n, group, ratios = 32, 8, 8, np.linspace(1.0, 0.5, 6)
    x = (rng.standard_normal((256, k)) * rng.uniform(0.3, 3.0, k)).astype(np.float32)
    w = rng.standard_t(3, (k, n)).astype(np.float32)  # heavy tails: clipping pays
    h = (x.T @ x).astype(np.float64)
    quantizer = _int4(qbits.Tiled(tile_size=group))
    base = _awq(w, h, np.abs(x).mean(0), quantizer, grid=3, clip_grid=1)
    out = _awq(w, h, np.abs(x).mean(0), quantizer, grid=3, clip_grid=6)
    assert float(out.alpha) == float(base.alpha)  # the scales come first
    s = np.asarray(out.scales, np.float64)[:, None]
    sw = s * w
    blocks = [slice(i, i + group) for i in range(0, k, group)]
    picked = np.empty((k // group, n))
    for g, rows in enumerate(blocks):  # brute force, per block and column
        errs = []
        for r in ratios:
            eff = _np_quant(sw[rows], r * _np_scale(sw[rows])) / s[rows]
            d = w[rows] - eff
            errs.append(np.einsum("in,ij,jn->n", d, h[rows, rows], d))
        picked[g] = ratios[np.argmin(errs, axis=0)]
    assert (picked < 1).any()  # the search does something here
    np.testing.assert_allclose(out.clip, picked, rtol=1e-6)
    assert float(out.error) < float(base.error)
    np.testing.assert_allclose(
        out.error, _np_error(w, np.asarray(out.weight, np.float64), h), rtol=1e-3
    )


def test_awq_bad_arguments_raise():
    w, h = np.ones((4, 2), np.float32), np.eye(4, dtype=np.float32)
    with pytest.raises(qbits.InvalidArgumentError, match="act_absmean"):
        _awq(w, h, np.ones(3), _int4(qbits.PerChannel()))
    with pytest.raises(qbits.InvalidArgumentError, match="grid"):
        _awq(w, h, np.ones(4), _int4(qbits.PerChannel()), grid=0)
    with pytest.raises(qbits.InvalidArgumentError, match=r"act_absmean.*1 NaN"):
        _awq(w, h, np.array([1.0, np.nan, 1.0, 1.0]), _int4(qbits.PerChannel()))


# --- SmoothQuant -------------------------------------------------------------


def _outlier_inputs(rng, rows=64, k=32, n=16):
    x = rng.standard_normal((rows, k)) * np.where(np.arange(k) % 11 == 3, 60.0, 1.0)
    return x.astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)


def test_smooth_scales_formula_and_the_float_matmul_is_unchanged():
    rng = np.random.default_rng(1)
    x, w = _outlier_inputs(rng)
    act = np.abs(x).max(0)
    act[0] = 0.0  # an input that never fires
    for alpha in (0.5, 0.8):
        s = ptq.smooth_scales(act, w, alpha=alpha)
        w_max = np.maximum(np.abs(w).max(1), 1e-5)
        want = np.maximum(act**alpha / w_max ** (1 - alpha), 1e-5)
        np.testing.assert_allclose(s, want, rtol=1e-5)
        smoothed = (x / s) @ (s[:, None] * w)  # x @ w == (x / s) @ (s w)
        np.testing.assert_allclose(smoothed, x @ w, rtol=1e-4, atol=1e-4)
    with pytest.raises(qbits.InvalidArgumentError, match="alpha"):
        ptq.smooth_scales(act, w, alpha=1.5)
    with pytest.raises(qbits.InvalidArgumentError, match="act_absmax"):
        ptq.smooth_scales(act[:4], w)


def test_smoothing_lowers_the_w8a8_error_on_outlier_channels():
    rng = np.random.default_rng(2)
    x, w = _outlier_inputs(rng)
    act8 = qbits.Quantizer(qbits.IntNumerics(bits=8), granularity=qbits.PerTensor())
    w8 = qbits.Quantizer(
        qbits.IntNumerics(bits=8), granularity=qbits.PerChannel(shared_axes=(0,))
    )

    @jax.jit
    def w8a8_error(x, w):
        y = act8.quant(x).dequant() @ w8.quant(w).dequant()
        return jnp.sum((y - x @ w) ** 2)

    s = ptq.smooth_scales(np.abs(x).max(0), w)
    xs, ws = x / s, s[:, None] * w
    assert w8a8_error(xs, ws) < 0.5 * w8a8_error(x, w)


# --- Rotations ---------------------------------------------------------------


def test_hadamard_is_orthonormal():
    for n in (1, 2, 12, 20, 28, 36, 48, 64, 80, 108):  # Sylvester, Paley I, II
        keys = (None, jax.random.key(n)) if n in (12, 28) else (None,)
        for key in keys:
            q = np.asarray(ptq.hadamard(n, key), np.float64)
            np.testing.assert_allclose(q @ q.T, np.eye(n), atol=1e-6)
            np.testing.assert_allclose(np.abs(q), 1 / np.sqrt(n), rtol=1e-6)


@pytest.mark.parametrize("n", [3, 6, 172])
def test_hadamard_without_a_construction_raises(n):
    with pytest.raises(qbits.InvalidArgumentError, match="Paley"):
        ptq.hadamard(n)


def test_rotation_keeps_the_matmul_and_spreads_an_outlier():
    rng = np.random.default_rng(3)
    k, n = 64, 16
    x = rng.standard_normal((8, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    w[9] *= 50.0  # an outlier input channel
    q = ptq.hadamard(k, jax.random.key(0))
    rotated = q.T @ w  # x @ w == (x Q) @ (Q^T w)
    y = (x @ q) @ rotated
    np.testing.assert_allclose(y, x @ w, rtol=1e-4, atol=1e-3)
    int4 = _int4(qbits.PerChannel(shared_axes=(0,)))

    @jax.jit
    def rtn_error(w):  # ||w - Q(w)||: the same in both bases (q orthogonal)
        return jnp.sum((int4.quant(w).dequant() - w) ** 2)

    assert rtn_error(rotated) < 0.25 * rtn_error(jnp.asarray(w))
