"""``quantize_weights``: post-training quantization of a whole model's weights.

One driver for any function or model the engine reaches: it collects every
weight matmul's input statistics over the calibration batches
(:func:`~qbits.ptq.collect_stats`), takes each weight's target grid from the
rules config (the weight side of its forward matmul), and replaces the
weight by what round-to-nearest, GPTQ or AWQ makes of it, layer by layer
(one layer of a scan over stacked layers, one group of a per-group weight
at a time). The result is float parameters whose weights lie on their
grids (AWQ: the effective weight ``Q(s w) / s``), ready to evaluate and
to compare. SmoothQuant scales and rotations (:mod:`._transforms`) change
the weights and the activations they meet: :meth:`PtqResult.function` runs
the model with both.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import types
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from qbits import transform
from qbits._errors import InvalidArgumentError, check_bool, check_float
from qbits._quantizer import Quantizer
from qbits.config import QuantConfig, Rule, _as_quant_config
from qbits.numerics import NoNumerics
from qbits.ops import DotGeneralConfig
from qbits.ptq._collect import MatmulStats, collect_stats
from qbits.ptq._fold import check_fold, check_folded, fold_awq
from qbits.ptq._gptq import GptqResult, check_quantizer, output_error
from qbits.ptq._method import Method, by_name, method_class, settings
from qbits.ptq._plan import Weight, check_alone, check_inputs, check_some, plan
from qbits.ptq._propagate import PairStats, propagated_stats
from qbits.ptq._rtn import rtn
from qbits.ptq._stats import InputStats
from qbits.ptq._stored import stored_weight
from qbits.ptq._transforms import ACTIVATION, Transform

_OWNER = "qbits.ptq.quantize_weights"


@dataclasses.dataclass(frozen=True)
class LayerReport:
    """What :func:`quantize_weights` did to one weight: a row of ``PtqResult.layers``.

    One report per weight quantized: per weight matmul, except that the
    matmuls that multiply by the same parameter entries in the same layout
    (``x @ w + relu(x @ w)``: ``w`` and ``w#2``) share one weight,
    quantized once on their statistics merged, and one report.

    Attributes:
      path: The (first) matmul's path, as :func:`qbits.layer_table` names it.
      param: The key path of its weight parameter (``jax.tree_util.keystr``).
      method: The method's name (:attr:`Method.name`): ``"rtn"``,
        ``"gptq"``, ``"awq"``...
      error_rtn: The output error of round-to-nearest on the calibration
        set, ``tr((w - w_hat)^T H (w - w_hat)) / rows``, summed over the
        layer's scan steps and groups (and its matmuls: ``H`` and ``rows``
        summed over them).
      error: The same for ``method``'s weight.
      uses: Every matmul that multiplies by this weight, ``path`` first.

    Example:
      >>> def fc(params, x):
      ...     return x @ params["w"]
      >>> params = {"w": jnp.arange(32.0).reshape(8, 4) / 32}
      >>> x = jax.random.normal(jax.random.key(0), (16, 8))
      >>> out = qbits.ptq.quantize_weights(fc, params, [x], "int8_fwd", method="gptq")
      >>> r = out.layers[0]
      >>> r.path, r.param, r.method, r.uses, r.error <= r.error_rtn
      ('w', "['w']", 'gptq', ('w',), True)
    """

    path: str
    param: str
    method: str
    error_rtn: float
    error: float
    uses: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.uses:
            object.__setattr__(self, "uses", (self.path,))


class PtqResult(NamedTuple):
    """What :func:`quantize_weights` returns.

    Attributes:
      params: ``params`` with every quantized weight replaced (same tree,
        shapes and dtypes).
      layers: One report per weight, in the order of the statistics: per
        weight matmul, with the matmuls that share a weight in one. Each
        has ``path`` (the first matmul's, as :func:`qbits.layer_table`
        names it), ``param`` (the key path of its parameter), ``method``
        (:attr:`Method.name`), ``error_rtn`` (the output error of
        round-to-nearest on the calibration set, ``tr((w - w_hat)^T H (w -
        w_hat)) / rows``, summed over scan steps, groups and the matmuls
        sharing the weight), ``error`` (the same for the method's weight)
        and ``uses`` (every matmul that multiplies by the weight).
      config: The rules to run ``params`` with: the given config with the
        weight quantizer of every weight written here removed (the weights
        are on their grids already), so ``qbits.quantize(fn, result.config)``
        quantizes only what the config quantizes besides those weights:
        activations (W8A8), and matmuls without a weight (attention's
        scores) as the config runs them there
        (:meth:`~qbits.DotGeneralConfig.for_activations`: float under a
        weight-only config). To run only the written weights,
        ``result._replace(config=qbits.QuantConfig())``.
      transforms: ``{matmul path: {"scale": s, "rotation": Q}}`` for the
        matmuls whose activation is transformed online (``smooth``,
        ``rotate``; empty without): their weights in ``params`` are the
        transformed ones, so run the model with :meth:`function`.
      stored: ``{matmul path: QTensor}``: each weight the method put on its
        quantizer's grid (``"rtn"``, ``"gptq"``), stored as serving stores
        it (:func:`qbits.serving.convert`) with the method's own
        codes and scales, zero points and tensor scale, so that serving
        keeps them: ``qbits.serving.convert(fn, config, result, x)`` (the
        config given to :func:`quantize_weights`) takes them, as does
        ``qbits.quantize(fn, config, stored=result.stored)``. Matmuls that
        share a weight (``w``, ``w#2``) share its stored weight. AWQ's weights
        (``Q(s w) / s``) are left out (with ``fold``, its ``Q(s w)`` are
        in), and so is a weight whose scale blocks
        on ``(K, N)`` are not those of its operand (NVFP4's tensor scale,
        one per ``(K, N)`` matrix, of a weight with a matrix per group:
        serving quantizes those again), and one whose blocks fit ``(K, N)``
        but not the operand's own axes (serving refuses that config).

    Example:
      >>> out = qbits.ptq.PtqResult({"w": jnp.ones((2, 2))}, (), qbits.QuantConfig())
      >>> out.layers, out.config.default is None, dict(out.transforms), dict(out.stored)
      ((), True, {}, {})
    """

    params: Any
    layers: tuple[LayerReport, ...]
    config: Any  # a qbits.QuantConfig (Any: one link target in the docs)
    transforms: Mapping[str, Any] = types.MappingProxyType({})
    stored: Mapping[str, Any] = types.MappingProxyType({})

    def function(
        self, fn: Callable[..., Any], key: jax.Array | None = None
    ) -> Callable[..., Any]:
        """``fn`` as it runs on :attr:`params`: the one way to evaluate the result.

        ``qbits.quantize(fn, self.config)`` (the quantizers besides the
        weights written, W8A8's activations), with each transformed
        matmul's activation divided by its SmoothQuant scales and rotated
        before it is quantized (:func:`qbits.transform.adapt`).

        Args:
          fn: The function given to :func:`quantize_weights`.
          key: A PRNG key, for a config that rounds stochastically (its
            backward matmuls), as for :func:`qbits.quantize`.

        Returns:
          A function with ``fn``'s signature: call it with :attr:`params`.

        Example:
          >>> def f(params, x):
          ...     return x @ params["w"]
          >>> params = {"w": jnp.array([[1.0, 2.0], [3.0, 4.0]])}
          >>> x = jnp.array([[8.0, 1.0]])
          >>> out = qbits.ptq.quantize_weights(f, params, [x], "int8_fwd",
          ...                                  method="rtn", smooth=0.5)
          >>> sorted(out.transforms["w"])
          ['scale']
          >>> y = out.function(f)(out.params, x)  # W8A8 of x @ w = [[11, 20]]
          >>> [round(v, 1) for v in y[0].tolist()]
          [11.0, 19.9]
        """
        if not self.transforms:
            # What it quantizes besides the written weights may be nothing
            # (a weight-only result): not worth a warning here.
            caller = transform._Caller("qbits.ptq.PtqResult.function", whole=False)
            return transform._quantize(caller, fn, self.config, key=key)
        return transform.adapt(
            fn, self.config, ACTIVATION, dict(self.transforms), key=key
        )


def quantize_weights(
    fn: Callable[..., Any],
    params: Any,
    batches: Iterable[Any] | None,
    config: Any,
    *,
    stats: Mapping[str, MatmulStats] | None = None,
    method: Method | str = "gptq",
    smooth: float | None = None,
    rotate: bool = False,
    key: jax.Array | None = None,
    progress: bool = False,
    fold: Mapping[str, Sequence[str]] | None = None,
    **deprecated: Any,
) -> PtqResult:
    """Quantizes every weight of ``fn(params, batch)`` after training.

    The statistics come from running ``fn`` in float on ``batches`` (they
    stream: one ``K x K`` Hessian per matmul in memory). Each weight matmul
    whose rule (``config``, as for :func:`qbits.quantize`) quantizes its
    weight in the forward matmul gets that quantizer's grid, ``fwd.rhs``
    (the engine runs ``w @ x`` as ``x @ w``, so the weight is always the
    rhs, as in :func:`qbits.quantize`); matmuls whose rule is float, or
    quantizes only the activation, keep their weight. Weight-only configs
    are evaluated as ``fn(result.params, x)`` in float; a config that also
    quantizes activations, with ``qbits.quantize`` and a config that
    quantizes only those: ``qbits.quantize(fn, result.config)``; either
    way, ``result.function(fn)(result.params, x)`` (which also applies
    ``smooth`` and ``rotate``).

    Each weight is quantized in the layout its matmul reads it in: a
    kernel the model transposes or reshapes before multiplying (Hugging
    Face's GPT-2 stores its kernels ``(out, in)``) is quantized as the
    matmul's ``(K, N)`` and written back where the matmul reads it
    (:meth:`MatmulStats.operand`); a weight the model broadcasts or slices
    is refused. Matmuls
    that multiply by the same entries of a parameter in the same layout
    (a weight used twice: ``w`` and ``w#2``) share one weight, quantized
    once on their statistics merged (GPTQ's ``H`` summed over them) and
    stored once for all of them; other layouts of the same entries, or
    other weight quantizers, are refused. The grid of a 4-bit symmetric
    :class:`~qbits.IntNumerics` weight is ``-7..7``, without the reference
    GPTQ's ``-8`` (see :func:`gptq`); ``w4g128_asym`` has 16 levels.

    ``smooth`` and ``rotate`` transform each quantized matmul ``x @ w``
    first, leaving the float model unchanged (:mod:`qbits.ptq`'s
    SmoothQuant and rotations): the weight once, here, before ``method``
    quantizes it on the transformed activation's statistics; the
    activation online, before the matmul quantizes it. They help where the
    activations are quantized too (W8A8), and rotations also spread a
    weight's outliers (GPTQ + rotation).

    The method is a value (:class:`Rtn`, :class:`Gptq`, :class:`Awq`,
    any :class:`Method`) holding its own settings. One that is
    :attr:`~Method.propagated` also gets the statistics of each weight's
    activation as the model computes it with the weights quantized before
    it: the weights are quantized in program order and the batches run
    again (``fn`` mapped over the float and the quantized parameters)
    before each weight, so ``batches`` must be given and iterable again (a
    list); a scan's stacked layers are one weight, quantized together.

    Args:
      fn: ``fn(params, batch)``: a linen model's ``apply``, any function.
      params: Its float parameters.
      batches: The calibration inputs, each passed as the second argument
        (an iterable; read once), or ``None`` with ``stats``.
      config: The rules: a :class:`~qbits.QuantConfig`, a config, a preset
        name or a YAML path.
      stats: Statistics that :func:`collect_stats` collected from
        ``fn``, ``params`` and ``config`` before, instead of ``batches``: to
        compare methods or settings without running the model again.
      method: The method: :class:`Rtn` (round to nearest), :class:`Gptq`
        (:func:`gptq`), :class:`Awq` (:func:`awq`: the effective weight
        ``Q(s w) / s``) with their settings, or a method's name for its
        defaults (``"gptq"``: ``Gptq()``).
      smooth: SmoothQuant's migration strength ``alpha`` in [0, 1]
        (:func:`smooth_scales` from the calibration set's ``max |x|``), or
        ``None`` for none.
      rotate: Rotate every quantized matmul's input channels by a Hadamard
        matrix (:func:`hadamard`; ``K`` must have a construction).
      key: With ``rotate``: random signs for the Hadamard matrices
        (QuaRot's randomized transform); ``None``: the plain matrix.
      progress: Show a progress bar over the layers.
      fold: With :class:`Awq` only: ``{layer before: matmul paths}``, the
        matmuls that read that layer's output (``{"blocks/0/norm1":
        ("blocks/0/attn/query", "blocks/0/attn/key")}``; a layer is the
        ``/`` path of its parameters' keys). AWQ's scales ``s`` are folded
        into the layer before, as AutoAWQ does: one ``s`` for all its
        matmuls (their errors summed), every parameter under it divided by
        ``s`` along its last axes (a norm's scale and bias, a projection's
        output channels), and each weight becomes ``Q(s w)``, on its grid
        and stored (:attr:`PtqResult.stored`): a result checkpoint formats
        hold. Weights in no entry get ``s = 1``. A layer before that is
        itself quantized here must come before the entry that quantizes it.
        Each layer before's output must be read by its listed matmuls alone:
        the folded model in float (``s w`` unquantized) is run on the first
        batch and refused where it differs from ``fn``.
      **deprecated: The settings this function took before methods were
        values, still accepted with a string ``method`` (with a
        ``DeprecationWarning`` that names the value to pass instead):
        ``damping``, ``act_order`` (``Gptq``), ``grid``, ``clip_grid``
        (``Awq``).

    Returns:
      A :class:`PtqResult`: the new params, a report per layer, the config
      and the transforms to run them with (:meth:`PtqResult.function`).

    Raises:
      InvalidArgumentError: For an unknown method, no batches (or both
        batches and stats; ``stats`` alone for a propagated method), a
        config that quantizes no weight of ``fn``, a weight quantizer with a
        scale provider or stochastic rounding, ``smooth`` outside [0, 1], a
        transform the method refuses (:meth:`Method.check`: AWQ with
        ``rotate``), a ``fold`` without AWQ or with ``smooth``, ``rotate``
        or ``stats``, naming a matmul or layer that is not there, matmuls
        that read other inputs or have other grids, a layer whose parameters
        do not end in ``K`` channels, a weight of stacked layers or groups,
        or entries in an order that divides a weight already quantized;
        a ``K`` with no Hadamard matrix, ``smooth`` or
        ``rotate`` of a weight read by more than its matmul (a tied
        embedding's lookup would read the transformed table), a parameter two
        matmuls quantize in other layouts or on other grids (naming both),
        a weight the model broadcasts or slices, calibration statistics or
        weights with NaN or inf (naming the matmul; checked before any
        method runs), and the errors of :func:`collect_stats` and of the
        method (naming the weight).
      TypeError: For an unexpected keyword argument.
      ConfigError: For a bad config.

    Example:
      >>> def mlp(params, x):
      ...     return jax.nn.relu(x @ params["w1"]) @ params["w2"]
      >>> k = jax.random.split(jax.random.key(0), 3)
      >>> params = {"w1": jax.random.normal(k[0], (16, 32)),
      ...           "w2": jax.random.normal(k[1], (32, 8))}
      >>> batches = [jax.random.normal(k[2], (64, 16))]
      >>> gptq = qbits.ptq.Gptq(damping=0.02)
      >>> out = qbits.ptq.quantize_weights(mlp, params, batches, "int8_fwd",
      ...                                  method=gptq)
      >>> [(r.path, r.method, r.error <= r.error_rtn) for r in out.layers]
      [('w1', 'gptq', True), ('w2', 'gptq', True)]
    """
    method = _method(method, deprecated)
    quant = _as_quant_config(_OWNER, config)
    if smooth is not None:
        check_float(_OWNER, "smooth", smooth, lo=0.0, hi=1.0)
    check_bool(_OWNER, "rotate", rotate)
    method.check(_OWNER, smooth=smooth, rotate=rotate)
    if fold is not None:
        fold = check_fold(_OWNER, fold, method, smooth, rotate, stats)
    if method.propagated and batches is None:
        raise InvalidArgumentError(
            _OWNER, "batches", None,
            f"the calibration batches (a list: they run again before each "
            f"weight) for {method!r}",
            why="it needs the statistics of the activations of the quantized "
            "model, which precomputed stats do not hold",
        )  # fmt: skip
    if method.propagated:
        batches = list(batches)
    if (batches is None) == (stats is None):
        raise InvalidArgumentError(
            _OWNER,
            "stats",
            "given" if stats is not None else None,
            "either batches or stats (from qbits.ptq.collect_stats), not both",
        )
    if stats is None:
        it = iter(batches)
        first = next(it, None)
        if first is None:
            raise InvalidArgumentError(_OWNER, "batches", batches, "at least one batch")
        stats = collect_stats(fn, params, itertools.chain([first], it), config=quant)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    where = {jax.tree_util.keystr(p): i for i, (p, _) in enumerate(leaves)}
    values = [leaf for _, leaf in leaves]
    weights = plan(_OWNER, stats, quant, values, where)
    check_some(_OWNER, config, quant, weights)
    check_inputs(_OWNER, "stats" if batches is None else "batches", weights, values)
    if smooth is not None or rotate:
        name = "smooth" if smooth is not None else "rotate"
        check_alone(_OWNER, name, smooth if smooth is not None else rotate, weights)
    reports, written, transforms, stored = [], [], {}, {}
    if fold is not None:
        names = [_key_names(p) for p, _ in leaves]
        done = fold_awq(_OWNER, weights, values, names, fold, method)
        floats = list(values)  # the layers before divided, the weights s w
        for w, *_, scaled in done:
            sw = w.ms.write(values[w.leaf], _unmatrix(w.ms, scaled))
            floats[w.leaf] = sw.astype(values[w.leaf].dtype)
        folded = jax.tree_util.tree_unflatten(treedef, floats)
        check_folded(_OWNER, fn, params, folded, first, fold)
        for w, mat, errors, grid, _ in sorted(done, key=lambda d: weights.index(d[0])):
            new = _unmatrix(w.ms, mat)
            values[w.leaf] = w.ms.write(values[w.leaf], new).astype(
                values[w.leaf].dtype
            )
            reports.append(
                LayerReport(w.ms.path, w.param, method.name, *errors, w.paths)
            )
            qt = stored_weight(w.ms, new, w.quantizer, [grid])
            for ms, cfg in zip(w.uses, w.configs, strict=True):
                if qt is not None:
                    stored[ms.path] = qt
                written.append(_without_weight(ms.path, cfg))
        weights = []  # all done
    for w in tqdm(weights, desc="ptq", unit="layer", disable=not progress):
        k = w.stats.hessian.shape[-1]
        try:
            t = Transform.create(smooth, rotate, key, k)
        except InvalidArgumentError as e:
            raise InvalidArgumentError(
                _OWNER, "rotate", True,
                f"rotate=False, or a model whose {w.ms.path!r} has a K with a "
                "Hadamard matrix", why=f"{w.ms.path!r} has K = {k}: {e}",
            ) from None  # fmt: skip
        pairs = None
        if method.propagated:  # the inputs of the weights quantized so far
            now = jax.tree_util.tree_unflatten(treedef, values)
            uses = [(ms.path, ms.stats.rows.shape) for ms in w.uses]
            pairs = propagated_stats(_OWNER, fn, params, now, batches, uses)
        try:
            check_quantizer(_OWNER, w.quantizer)
            new, report, data, qt = _one_weight(w, values[w.leaf], method, t, pairs)
        except InvalidArgumentError as e:
            if f"{w.ms.path!r}" in str(e):
                raise
            raise InvalidArgumentError(
                _OWNER, "config", f"the weight quantizer of {w.ms.path!r}",
                "a weight quantizer that fits the weight, computes its scale "
                "and rounds to nearest", why=str(e),
            ) from None  # fmt: skip
        values[w.leaf] = new
        reports.append(report)
        for ms, cfg in zip(w.uses, w.configs, strict=True):
            if data:
                transforms[ms.path] = data
            if qt is not None:
                stored[ms.path] = qt
            written.append(_without_weight(ms.path, cfg))
    new_params = jax.tree_util.tree_unflatten(treedef, values)
    # A rule for fc1 also matches its later use fc1#2: those first.
    written.sort(key=lambda r: "#" not in r.pattern)
    rules = QuantConfig((*written, *quant.rules), quant.default, source=quant.source)
    return PtqResult(new_params, tuple(reports), rules, transforms, stored)


def _key_names(path: tuple[Any, ...]) -> tuple[str, ...]:
    """A parameter's keys as strings, without a Variable's ``.value``."""
    names = tuple(
        str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path
    )
    last = path[-1] if path else None
    return names[:-1] if isinstance(last, jax.tree_util.GetAttrKey) else names


def _without_weight(path: str, cfg: DotGeneralConfig) -> Rule:
    """A rule for exactly ``path``: ``cfg`` without its forward weight quantizer.

    The weight's is ``fwd.rhs`` whichever operand the weight is: the engine
    runs a matmul whose weight is its lhs with the operands swapped.
    """
    fwd = cfg.fwd.replace(rhs=Quantizer(NoNumerics()))
    kept = cfg.replace(fwd=fwd)
    plain = all(m.is_identity for m in (kept.fwd, kept.dlhs, kept.drhs))
    return Rule(re.escape(path), None if plain else kept)


def _method(method: Any, deprecated: dict[str, Any]) -> Method:
    """``method`` as a value, with the settings given the old way moved into it."""
    moved = {"damping": "gptq", "act_order": "gptq", "grid": "awq", "clip_grid": "awq"}
    for name in deprecated:
        if name not in moved:
            raise TypeError(f"{_OWNER}() got an unexpected keyword argument {name!r}")
    if not deprecated:
        return by_name(_OWNER, method)
    given = ", ".join(f"{k}={v!r}" for k, v in deprecated.items())
    if not isinstance(method, str) or method_class(method) is None:
        first = next(iter(deprecated))
        raise InvalidArgumentError(
            _OWNER, first, deprecated[first],
            "a method value with its settings, e.g. method=qbits.ptq.Gptq("
            "damping=0.02) or qbits.ptq.Awq(grid=10)",
            why=f"{given}: a method's settings are fields of its value now",
        )  # fmt: skip
    cls = method_class(method)
    own = {k: v for k, v in deprecated.items() if k in settings(cls)}
    value = cls(**own)
    warnings.warn(
        f"{_OWNER}(method={method!r}, {given}) is deprecated: pass "
        f"method=qbits.ptq.{value!r}"
        + ("" if len(own) == len(deprecated) else f" ({method} ignores the rest)"),
        DeprecationWarning,
        stacklevel=3,
    )
    return value


def _one_weight(
    w: Weight,
    param: Any,
    method: Method,
    t: Transform,
    pairs: PairStats | None,
) -> tuple[jax.Array, LayerReport, dict[str, jax.Array], Any]:
    """The new parameter, the weight's report, its transform's data, its QTensor.

    The weight is read from the parameter in its matmuls' layout, each
    layer and group quantized alone, and written back; the data stacked
    like the statistics (``(*layers, *groups, ...)``); the stored weight
    (or ``None``) as :attr:`PtqResult.stored` holds it.
    """
    ms, quantizer = w.ms, w.quantizer
    lead = ms.layers
    w_all = ms.operand(param)
    out, datas, grids = [], [], []
    err_rtn = err = 0.0
    for layer in np.ndindex(*lead):
        mats = ms.matrix(w_all[layer])
        groups = mats.shape[:-2]
        new_mats = []
        for g in np.ndindex(*groups):
            at = (*layer, *g)
            s = jax.tree.map(lambda a, at=at: a[at], w.stats)
            m = mats[g]
            w_rtn = rtn(m, quantizer).weight
            wt, st, data = t.apply(m, s)
            if pairs is not None:
                st = dataclasses.replace(
                    st, quantized_hessian=t.gram(pairs.quantized_hessian[at], data),
                    cross=t.gram(pairs.cross[at], data))  # fmt: skip
            got = _run_method(method, wt, st, quantizer, ms.path)
            if isinstance(got, GptqResult):  # on the grid, with its scales
                grids.append(got)
                got = got.weight
            w_new = jnp.asarray(got, wt.dtype)
            w_eff = w_new if t.identity else t.effective(w_new, data)
            errors = _errors(m, w_rtn, w_eff, s.hessian, s.rows)
            err_rtn, err = err_rtn + float(errors[0]), err + float(errors[1])
            new_mats.append(w_new)
            datas.append(data)
        stacked = jnp.stack(new_mats).reshape(mats.shape)
        out.append(_unmatrix(ms, stacked))
    new = (jnp.stack(out).reshape(w_all.shape) if lead else out[0]).astype(w_all.dtype)
    report = LayerReport(ms.path, w.param, method.name, err_rtn, err, w.paths)
    # Stored where every matrix is on the grid (a method may leave some off).
    on_grid = grids and len(grids) == len(datas)
    qt = stored_weight(ms, new, quantizer, grids) if on_grid else None
    shape = (*lead, *ms.stats.rows.shape[len(lead) :])
    data = {
        name: jnp.stack([d[name] for d in datas]).reshape(*shape, *v.shape)
        for name, v in (datas[0] if datas else {}).items()
    }
    return ms.write(param, new), report, data, qt


def _run_method(
    method: Method, w: jax.Array, stats: InputStats, quantizer: Quantizer, path: str
) -> Any:
    """``method.quantize``, its errors naming the weight (a method sees one matrix)."""
    try:
        return method.quantize(w, stats, quantizer)
    except InvalidArgumentError as e:
        where = f"the weight of {path!r}"
        why = f"{where}: {e.why}" if e.why else where
        raise InvalidArgumentError(
            e.owner, e.argument, e.value, e.allowed, why=why
        ) from e


@jax.jit
def _errors(
    w: jax.Array, w_rtn: jax.Array, w_new: jax.Array, h: jax.Array, rows: jax.Array
) -> jax.Array:
    """The mean output errors of ``w_rtn`` and ``w_new`` per calibration row."""
    rows = jnp.maximum(rows, 1.0)
    return jnp.stack([output_error(w, w_rtn, h), output_error(w, w_new, h)]) / rows


def _unmatrix(ms: MatmulStats, mats: jax.Array) -> jax.Array:
    """The inverse of :meth:`MatmulStats.matrix`: one layer's weight again."""
    order = (*ms.batch, *ms.contracting, *ms.free)
    moved = mats.reshape(tuple(ms.shape[a] for a in order))
    return jnp.transpose(moved, np.argsort(order))
