"""search_budget: the knapsack against brute force, budgets, YAML, a tiny model."""

import itertools
import math

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qbits
from qbits import diagnostics
from qbits.diagnostics._search import _knapsack

CANDIDATES = ["w4a8", "int8_fwd", None]


@st.composite
def _instances(draw):
    items = draw(st.integers(1, 4))
    options = [draw(st.integers(1, 3)) for _ in range(items)]
    costs = [[draw(st.integers(0, 6)) for _ in range(n)] for n in options]
    values = [
        [draw(st.floats(-2, 2, allow_nan=False, width=32)) for _ in range(n)]
        for n in options
    ]
    return costs, values, draw(st.integers(0, 15))


@settings(max_examples=80, deadline=None)
@given(_instances())
def test_knapsack_is_exact(instance):
    """The DP's choice fits and is as good as the best of all choices."""
    costs, values, capacity = instance
    best = math.inf
    for pick in itertools.product(*(range(len(c)) for c in costs)):
        if sum(c[j] for c, j in zip(costs, pick, strict=True)) <= capacity:
            best = min(best, sum(v[j] for v, j in zip(values, pick, strict=True)))
    got = _knapsack(costs, values, capacity)
    if best == math.inf:
        assert got is None
        return
    assert sum(c[j] for c, j in zip(costs, got, strict=True)) <= capacity
    assert sum(v[j] for v, j in zip(values, got, strict=True)) == pytest.approx(
        best, abs=1e-9
    )


def _block(p, x):
    """One attention-and-MLP block (width 16): 3 weight matmuls, 2 einsums."""
    q, k = x @ p["query"], x @ p["key"]
    w = jax.nn.softmax(jnp.einsum("td,sd->ts", q, k) / 4.0)
    h = x + jnp.einsum("ts,sd->td", w, x)
    return jnp.mean((jax.nn.gelu(h) @ p["fc"] - x) ** 2)


def _w4_tiles(size):
    return qbits.DotGeneralConfig(
        fwd=qbits.MatmulConfig(
            lhs=qbits.presets.get("w4a8").fwd.lhs,
            rhs=qbits.Quantizer(
                qbits.IntNumerics(bits=4), qbits.AbsMax(), qbits.Tiled(tile_size=size)
            ),
        )
    )


@pytest.fixture(scope="module")
def searched():
    keys = jax.random.split(jax.random.key(0), 4)
    shapes = {"query": (16, 16), "key": (16, 16), "fc": (16, 16)}
    params = {
        n: jax.random.normal(k, s) / 4
        for (n, s), k in zip(shapes.items(), keys[:3], strict=True)
    }
    batches = [
        jax.random.normal(jax.random.fold_in(keys[3], i), (8, 16)) for i in (0, 1)
    ]
    # int4 in tiles of 16 on a contraction of 16 stores int4 per channel:
    # measured once (the compilations counted).
    candidates = {"w4a8": "w4a8", "w4g16": _w4_tiles(16), "int8_fwd": "int8_fwd",
                  "float": None}  # fmt: skip
    compiled = []
    quantize = qbits.transform._quantize
    with pytest.MonkeyPatch.context() as m:
        m.setattr(
            qbits.transform, "_quantize", lambda *a: compiled.append(a) or quantize(*a)
        )
        found = diagnostics.search_budget(_block, params, batches, candidates, 6.0)
    assert len(compiled) == 1 + 3 * 2 + 1  # reference, w4a8 and int8_fwd, choice
    return found, params, batches


def test_tiny_block_end_to_end(searched):
    """Every weight matmul measured; the choice fits; losses add up."""
    found = searched[0]
    assert list(found.choices) == ["query", "key", "fc"]
    assert found.bits <= 6.0 and found.nbytes == sum(
        found.costs[p][lb] for p, lb in found.choices.items()
    )
    # int4 per channel: 16x16 codes packed two per byte + 16 float32 scales.
    assert found.costs["query"] == {"w4a8": 128 + 64, "w4g16": 128 + 64,
                                    "int8_fwd": 256 + 64, "float": 1024}  # fmt: skip
    assert all(d["float"] == 0.0 for d in found.sensitivity.values())
    assert all(
        d["w4g16"] == d["w4a8"] != d["int8_fwd"] for d in found.sensitivity.values()
    )
    assert found.expected_loss == pytest.approx(
        found.reference_loss
        + sum(found.sensitivity[p][lb] for p, lb in found.choices.items())
    )
    assert math.isfinite(found.measured_loss)
    # Not every matmul can have int8 at 6 bits: the budget binds.
    assert set(found.choices.values()) >= {"w4a8"}
    report = found.report()
    assert "| fc |" in report and "expected" in report


def test_budgets_are_respected_and_monotone(searched):
    found, _, _ = searched
    least = sum(min(c.values()) for c in found.costs.values())
    previous, least_bits = math.inf, 8 * least / sum(found.elements.values())
    for bits in (least_bits + b for b in (0.0, 0.25, 0.5, 2.0, 8.0, 30.0)):
        at = found.with_budget(bits)
        assert at.bits <= bits
        assert at.expected_loss <= previous + 1e-12  # more bits never hurt
        previous = at.expected_loss
    at = found.with_budget(least, "bytes")
    assert at.nbytes == least
    with pytest.raises(qbits.InvalidArgumentError, match="budget"):
        found.with_budget(least - 1, "bytes")
    with pytest.raises(qbits.InvalidArgumentError, match="unit"):
        found.with_budget(5.0, "words")


def test_yaml_round_trip_reproduces_the_choice(searched, tmp_path):
    """The YAML's rules give every matmul the chosen format, and the loss."""
    found, params, batches = searched
    path = tmp_path / "searched.yaml"
    qbits.config.dump(found.config, path)
    loaded = qbits.load_config(path)
    assert loaded == found.config
    table = qbits.layer_table(_block, loaded, params, batches[0])
    labels = {"w4a8": "w4a8", "int8_fwd": "int8_fwd", "float": "float"}
    assert "w4g16" not in found.choices.values()  # w4a8 first: ties keep it
    for p, label in found.choices.items():
        assert table[p].describe() == labels[label], p
    quantized = jax.jit(qbits.quantize(_block, loaded))
    got = jnp.mean(jnp.stack([quantized(params, b) for b in batches]))
    assert float(got) == pytest.approx(found.measured_loss, rel=1e-5)


def test_bad_arguments_are_refused(searched):
    _, params, batches = searched
    for kwargs, arg in [
        ({"budget": -1.0}, "budget"),
        ({"budget": 5.0, "unit": "words"}, "unit"),
        ({"budget": 5.0, "resolution": 0}, "resolution"),
    ]:
        with pytest.raises(qbits.InvalidArgumentError, match=arg):
            diagnostics.search_budget(_block, params, batches, CANDIDATES, **kwargs)
    with pytest.raises(qbits.InvalidArgumentError, match="batches"):
        diagnostics.search_budget(_block, params, [], CANDIDATES, 5.0)
    with pytest.raises(qbits.InvalidArgumentError, match="candidates"):
        diagnostics.search_budget(_block, params, batches, [], 5.0)
    with pytest.raises(qbits.ConfigError, match="int9"):
        diagnostics.search_budget(_block, params, batches, ["int9"], 5.0)
