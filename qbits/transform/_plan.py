"""Which matmul sites of a traced program run quantized, and how.

A :class:`Plan` decides, from the rules, which sites of a
:class:`~qbits.transform._program.Program` run through qbits' core, with
which config (:func:`applied`: what a rule's config runs on a matmul of two
activations), key stream, scale state, stored weight, probe or adapter, and
checks each against its matmul before anything runs; :class:`Caller` names
the entry point in its errors and warnings. :mod:`._runner` runs the plan.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import sys
import warnings
from collections.abc import Callable, Collection
from typing import Any, TypeVar

import flax
import jax

from qbits._errors import ConfigError, InvalidArgumentError
from qbits._granularity import PerTensor
from qbits._providers import DelayedScaling
from qbits.config import QuantConfig, Resolution
from qbits.ops import DotGeneralConfig
from qbits.transform._adapter import DATA, Adapter
from qbits.transform._checks import check_fits
from qbits.transform._observe import (
    ObservedMatmul,
    Observer,
    describe,
)
from qbits.transform._program import Ctx, Program, Site
from qbits.transform._swap import swapped_call

__all__ = [
    "DIAGNOSTICS",
    "Caller",
    "Plan",
    "Planned",
    "applied",
    "entry_point",
]

# The prefix of a probe's name among a run's per-site data (as the adapter
# data's, :data:`~._adapter.DATA`).
DIAGNOSTICS = "/diagnostics/"


@dataclasses.dataclass(frozen=True)
class Caller:
    """Who runs the engine, as errors name it.

    Every entry point (``qbits.quantize``, the linen and nnx adapters,
    serving) runs the same engine; its errors name the entry point and the
    argument as the user wrote it (``rngs['quant']`` rather than ``key``).

    Attributes:
      owner: The entry point, e.g. ``"qbits.quantize"``.
      key: How the PRNG key for stochastic rounding is passed.
      state: How the scale state is passed.
      state_fix: How to make the state, for the error that misses it.
      whole: Whether the function runs the whole model, so that a rule that
        matches no matmul, or a config that quantizes nothing, is worth a
        warning (a method that runs part of a model is not; nor is an entry
        point's second trace of the same call: it warns once).
      identity: What the function is made of, for the kept programs of
        ``quantize`` (:mod:`._cache`): ``(owner, *hashable extras)``, the
        same whenever it computes the same function (``None``: the function
        itself; an adapter that makes a new function for each call gives
        what it is made from). Not compared: a caller is part of a kept
        program's key, its owner is not.
    """

    owner: str = "qbits.quantize"
    key: str = "key"
    state: str = "state"
    state_fix: str = "qbits.init_state(fn, config, *args) makes it"
    whole: bool = True
    identity: tuple[Any, ...] | None = dataclasses.field(
        default=None, compare=False, repr=False
    )

    def check_inputs(
        self, method: Callable[..., Any], args: Any, kwargs: Any, call: str
    ) -> None:
        """Raises unless ``method`` takes ``(*args, **kwargs)``, naming the fix.

        For the entry points that trace a model on sample inputs: a model
        called without them (or with others) fails deep inside the engine
        with the model's own ``TypeError``; this names the inputs instead.

        Args:
          method: The model's method, bound (its signature is checked).
          args: The sample inputs given.
          kwargs: The keyword inputs given.
          call: The call to make, with ``{inputs}`` where the inputs go.

        Raises:
          InvalidArgumentError: Naming the missing (or extra) inputs and
            the call to make.
        """
        try:
            signature = inspect.signature(method)
            signature.bind(*args, **kwargs)
            return
        except ValueError:  # no signature to check (a builtin)
            return
        except TypeError as e:
            problem = str(e)
        required = [
            p.name
            for p in signature.parameters.values()
            if p.default is p.empty
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        given = f"{len(args)} positional input{'s' * (len(args) != 1)}"
        name = getattr(method, "__qualname__", "the model's call")
        raise InvalidArgumentError(
            self.owner,
            "*args",
            f"{given} and keywords {sorted(kwargs)}" if kwargs else given,
            f"the sample inputs of {name}{signature} (arrays or "
            f"jax.ShapeDtypeStruct s): {call.format(inputs=', '.join(required))}",
            why=problem,
        )


_F = TypeVar("_F", bound=Callable[..., Any])


def entry_point(caller: Caller) -> Callable[[_F], _F]:
    """The public entry point of ``run(caller, ...)``, its errors naming ``caller``.

    Each entry point of the engine is written once, as a function whose
    first parameter is the :class:`Caller` its errors name; this decorator
    makes the public function of its other parameters (the same name,
    docstring and signature, less ``caller``). The adapters, serving, ptq,
    lora and diagnostics call the function it wraps (``__wrapped__``,
    re-exported with a leading underscore by :mod:`qbits.transform`) with
    a caller of their own.
    """

    def public(run: _F) -> _F:
        @functools.wraps(run)
        def entry(*args: Any, **kwargs: Any) -> Any:
            return run(caller, *args, **kwargs)

        signature = inspect.signature(run)
        params = list(signature.parameters.values())[1:]
        entry.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        entry.__annotations__ = {
            k: v for k, v in run.__annotations__.items() if k != "caller"
        }
        return entry  # type: ignore[return-value]

    return public


@dataclasses.dataclass(frozen=True)
class Planned:
    """One site that runs through the core: its config and where it came from."""

    site: Site
    config: Any
    resolution: Resolution


class Plan:
    """Which sites run quantized, with which config, key stream and state.

    Args:
      program: The traced function.
      rules: The per-layer rules.
      caller: Named in errors.
      store: Serving: weight matmuls whose forward quantizes the weight run
        on a stored (already quantized) weight, forward only.
      observe: Observing activations: the weight ``dot_general`` s that
        the rules give a quantizing config (all of them with ``every``),
        outside ``cond``, ``while`` and ``shard_map`` bodies (what they
        record could not leave the body), run in float and hand their activation to it.
      every: With ``observe``: observe every weight matmul.
      adapter: Adapting weight matmuls: what the ones in ``adapted`` add
        to their output (their data: ``frame.states[DATA + path]``).
      adapted: The paths of the weight ``dot_general`` s to adapt (the
        caller checks that they are such matmuls, outside ``cond``,
        ``while`` and ``shard_map`` bodies).
      diagnose: Every quantized site measures its quantized operands: its
        probe (:func:`qbits.diagnostics.init`) is ``frame.states[DIAGNOSTICS
        + path]``, sliced per layer along a scan over stacked layers (none
        inside a ``shard_map`` body: the probe could not cross it).

    Raises:
      ConfigError: For a rule that gives an integer matmul a config, or (with
        ``store``) a stored weight matmul that rounds stochastically or keeps
        scale state.
      InvalidArgumentError: For scale state inside a ``cond`` or ``while``
        body, and inside a ``shard_map`` body other than per-tensor delayed
        scaling (and any with ``store``).
    """

    def __init__(
        self,
        program: Program,
        rules: QuantConfig,
        caller: Caller,
        *,
        store: bool = False,
        observe: Observer | None = None,
        every: bool = False,
        adapter: Adapter | None = None,
        adapted: Collection[str] = (),
        diagnose: bool = False,
    ):
        self.rules = rules
        self.caller = caller
        self.planned: dict[Ctx, Planned] = {}
        # Sites with per-site data (scale state or a stored weight): its name.
        self.state_keys: dict[Ctx, str] = {}
        self.stored: dict[Ctx, str] = {}
        # Serving: weight matmuls whose weight is quantized at every call,
        # not stored (the body or op it runs in; see _store's callers).
        self.on_the_fly: dict[str, str] = {}
        # The data of a weight matmul is stacked along the scans that slice
        # its weight (stacked layers), and shared by the iterations of the
        # others (a loop over micro-batches, one weight); that of an
        # activation matmul is stacked along every scan around it.
        self.sliced: dict[str, frozenset[Ctx]] = {}
        # The state entries that are replaced (not trained), per site: shared
        # along a loop, their uses combine with max.
        self.replaced: dict[str, tuple[str, ...]] = {}
        # dot_general sites whose weight is the lhs operand: run with the
        # operands swapped so that the weight gets the config's rhs side.
        self.swapped: set[Ctx] = set()
        self.observe = observe
        self.observed: dict[Ctx, ObservedMatmul] = {}
        self.holds: set[Ctx] = set()  # bodies holding a planned site
        self.needs_key: list[str] = []
        # Adapted weight matmuls: how the adapter sees each, its data's name.
        self.adapter = adapter
        self.adapted: dict[Ctx, ObservedMatmul] = {}
        self.adapter_data: dict[Ctx, str] = {}
        # Diagnosed sites: their probe's name.
        self.probes: dict[Ctx, str] = {}
        for site in program.sites:
            if site.path in adapted:
                self._adapt(site, program)
            res = rules.resolve(site.path)
            if site.integer and not site.frozen:
                self._check_integer(site, res)
            if site.kept:
                continue
            config = applied(site, res.config)
            if observe is not None:
                self._observe(site, config, res, program, every)
                continue
            if config is None or config.is_identity:
                continue
            # A weight in a cond, while or shard_map body is quantized on the
            # fly: the stored copy could not enter the body (like scale state).
            if store and _stores(config, site) and not (site.control or site.mapped):
                self._store(site, config, res)
            elif store and site.weights and not config.fwd.rhs.numerics.is_identity:
                self.on_the_fly[site.path] = _on_the_fly(site)
            elif config.needs_state:
                self._state(site, config, res, store)
            self._add(site, config, res)
            if config.needs_key:
                self.needs_key.append(site.path)
            if diagnose and site.ctx not in self.stored and not site.mapped:
                self._diagnose(site)
        if observe is None and adapter is None and caller.whole and not self.planned:
            _warn_if_nothing(program, rules, caller)

    def _add(self, site: Site, config: Any, res: Resolution) -> None:
        self.planned[site.ctx] = Planned(site, config, res)
        weight_left = site.lhs and not site.rhs
        if not site.op.limited and (weight_left or site.flipped):
            self.swapped.add(site.ctx)
        for n in range(1, len(site.ctx)):
            self.holds.add(site.ctx[:n])
        if config is not None:
            self._check_fits(site, config, res)

    def _observe(
        self, site: Site, config: Any, res: Resolution, program: Program, every: bool
    ) -> None:
        """Observing: a weight matmul the rules quantize (or ``every`` one)."""
        chosen = every or not (config is None or config.is_identity)
        weight = site.weights and not site.op.limited
        if chosen and weight and not (site.control or site.mapped):
            self._add(site, None, res)
            flip = site.ctx in self.swapped
            self.observed[site.ctx] = describe(site, program, flip)
            self.sliced[site.path] = next(iter(site.weights)).sliced

    def _store(self, site: Site, config: Any, res: Resolution) -> None:
        """Serving: the weight is stored, forward only, deterministic."""
        if config.needs_state or config.fwd.needs_key:
            what = ("rounds stochastically" if config.fwd.needs_key
                    else "takes its scales from state")  # fmt: skip
            raise ConfigError(
                f"{res.where}.fwd",
                f"a forward matmul that {what}",
                "a forward matmul that computes its scales and rounds "
                "to nearest (serving is deterministic and stateless)",
                why=f"matmul {site.path!r}, in {self.caller.owner}",
                source=self.rules.source,
            )
        self.stored[site.ctx] = site.path
        self.sliced[site.path] = next(iter(site.weights)).sliced

    def _state(self, site: Site, config: Any, res: Resolution, store: bool) -> None:
        """A config with scale state: its name, slicing and replaced entries."""
        if site.mapped and (store or not _replicated_state(config)):
            raise InvalidArgumentError(
                self.caller.owner,
                "config",
                f"{res.where}: {res.name or 'an inline config'} for matmul "
                f"{site.path!r}",
                "a config that computes its scales (e.g. 'fp8', 'int8') or "
                "keeps per-tensor delayed scaling ('fp8_delayed') for a matmul "
                f"inside a shard_map body, or qbits.Rule({site.base!r}, None)",
                why=(
                    "serving carries no scale state into a shard_map body"
                    if store
                    else "the engine carries only per-tensor delayed-scaling "
                    "state into a shard_map body (the same on every shard): for "
                    "other state there, quantize this matmul with "
                    "qbits.dot_general(config) inside the body (its state made "
                    "outside from the global operands, passed in replicated)"
                ),
            )
        if site.control:
            raise InvalidArgumentError(
                self.caller.owner,
                "config",
                f"the config of {site.path!r}",
                "a config without scale state for a matmul inside a "
                f"{site.control} body, or qbits.Rule({site.base!r}, None)",
                why="scale state cannot be carried through "
                f"{site.control} (an untaken branch or a repeated "
                "iteration would overwrite it)",
            )
        self.state_keys[site.ctx] = site.path
        if site.weights:
            self.sliced[site.path] = next(iter(site.weights)).sliced
        kinds = config.state_kinds()
        self.replaced[site.path] = tuple(k for k, v in kinds.items() if v == "replaced")

    def _diagnose(self, site: Site) -> None:
        name = self.probes[site.ctx] = DIAGNOSTICS + site.path
        if site.weights:
            self.sliced[name] = next(iter(site.weights)).sliced
        # Shared along a loop, the maxima of its uses combine with max.
        self.replaced[name] = ("maxima",)

    def _adapt(self, site: Site, program: Program) -> None:
        weight_left = bool(site.lhs and not site.rhs)
        self.adapted[site.ctx] = describe(site, program, weight_left)
        name = self.adapter_data[site.ctx] = DATA + site.path
        self.sliced[name] = next(iter(site.weights)).sliced
        for n in range(1, len(site.ctx)):
            self.holds.add(site.ctx[:n])

    def _check_fits(self, site: Site, config: Any, res: Resolution) -> None:
        """Raises a ConfigError naming the rule and the matmul for a misfit."""
        eqn, kind = site.eqn, site.op
        specs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
        call = kind.call(eqn.params, specs)
        if site.ctx in self.swapped:
            call, _ = swapped_call(call)
        check_fits(
            config, kind, call, eqn.outvars[0].aval.shape, res.where,
            layer=site.path, source=self.rules.source,
        )  # fmt: skip

    def _check_integer(self, site: Site, res: Resolution) -> None:
        """An integer matmul stays exact; only a rule's ``null`` may name it."""
        if res.rule is None or res.config is None or res.config.is_identity:
            return
        raise ConfigError(
            res.where,
            res.name or "a quantizing config",
            f"null for matmul {site.path!r} (its operands are "
            f"{site.operands}: integer matmuls are exact and stay as lax "
            "computes them)",
            why=f"rules[{res.rule}] (pattern {self.rules.rules[res.rule].pattern!r}) "
            "matches it",
            source=self.rules.source,
            layer=site.path,
        )

    def names_under(self, ctx: Ctx) -> list[str]:
        """The data names (state, stored weights, adapters) of sites in ``ctx``."""
        named = [*self.state_keys.items(), *self.stored.items(),
                 *self.adapter_data.items(), *self.probes.items()]  # fmt: skip
        return [
            name
            for site, name in named
            if len(site) > len(ctx) and site[: len(ctx)] == ctx
        ]


def _warn_if_nothing(program: Program, rules: QuantConfig, caller: Caller) -> None:
    """Warns that ``rules`` quantize nothing in ``program``, saying why.

    Silent when the rules quantize nothing anywhere (every config float or
    the identity: float on purpose).
    """
    if all(c.is_identity for c in rules.all_configs()):
        return
    if not program.sites:
        why = (
            "the function runs no matmul (no dot_general, einsum, @, "
            "convolution or ragged dot in its jaxpr)"
        )
    else:
        reasons = {}
        for site in program.sites:
            res = rules.resolve(site.path)
            if site.kept:
                reasons[site.path] = f"kept: {site.kept}"
            elif res.config is None:
                reasons[site.path] = f"{res.where}: null"
            elif applied(site, res.config) is None:
                reasons[site.path] = "weight-only config, no weight"
            else:
                reasons[site.path] = f"{res.where}: {res.name or 'an identity config'}"
        shown = [f"{path!r} ({why})" for path, why in list(reasons.items())[:4]]
        more = f" and {len(reasons) - 4} more" if len(reasons) > 4 else ""
        why = f"every matmul runs float: {', '.join(shown)}{more}"
    warnings.warn(
        f"{caller.owner}: the config {_name(rules)} quantizes nothing: {why}. "
        "qbits.layer_table lists the matmuls and the config each one gets",
        UserWarning,
        stacklevel=_outside(),
    )


_INSIDE = tuple(
    os.path.dirname(path) + os.sep
    for path in (os.path.dirname(__file__), jax.__file__, flax.__file__)
)


def _outside() -> int:
    """The ``stacklevel`` of the first caller outside qbits, jax and flax."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INSIDE):
        frame, level = frame.f_back, level + 1
    return level


def _name(rules: QuantConfig) -> str:
    """How a warning names the rules: their file, preset name or shape."""
    if rules.source:
        return repr(rules.source)
    if not rules.rules:
        return repr(rules.default) if isinstance(rules.default, str) else "(inline)"
    default = rules.default
    shown = repr(default) if isinstance(default, str | None) else "inline"
    return f"(rules {[r.pattern for r in rules.rules]}, default {shown})"


def applied(site: Site, config: DotGeneralConfig | None) -> DotGeneralConfig | None:
    """The config ``site`` runs with, its rule's config being ``config``.

    A matmul without a weight operand (two activations) runs
    :meth:`~qbits.DotGeneralConfig.for_activations` of it (float for a
    weight-only config); the others run it as it is. Every entry point
    (quantize, layer table, state, serving, statistics) plans with this.
    """
    if config is None or site.weights:
        return config
    return config.for_activations()


def _replicated_state(config: DotGeneralConfig) -> bool:
    """Whether ``config``'s scale state is the same on every shard.

    Per-tensor delayed scaling: a scale and an amax history per tensor,
    made without data; each shard's observed amax is maxed over the shards
    (as for state passed into a hand-written body), so every shard keeps
    the state the unsharded matmul keeps.
    """
    for _, _, q in config.quantizers():
        if q.provider is not None and not (
            isinstance(q.provider, DelayedScaling)
            and isinstance(q.granularity, PerTensor)
        ):
            return False
    return True


def _on_the_fly(site: Site) -> str:
    """Where a weight matmul runs whose weight serving quantizes at each call."""
    if site.op.limited:
        return site.op.limited
    body = "shard_map" if site.mapped else site.control
    return f"in a {body} body"


def _stores(config: Any, site: Site) -> bool:
    """Whether serving stores this site's weight (a quantized weight operand)."""
    if site.op.limited or not site.weights:
        return False
    return not config.fwd.rhs.numerics.is_identity
