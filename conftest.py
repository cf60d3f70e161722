"""Shared pytest setup for the tests and the docstring examples.

Strict dtype promotion is on everywhere, so a silent promotion (the way a
quantized path quietly becomes float) is an error. Hypothesis runs a fixed,
derandomized set of 10 examples a test in CI (simplest first); set
``HYPOTHESIS_PROFILE=dev`` for more.
"""

import json
import os
import subprocess
import sys
import tempfile

# The suite compiles thousands of small programs and runs most of them once,
# so XLA's CPU compiler is most of its time: LLVM's optimizations of the
# kernels cost more than they save (a quarter of the suite's time), and
# XLA's older fusion emitters (one elemental loop a fusion, no MLIR
# pipeline) compile a program in about 40% of the time the newer ones take
# (the suite's CPU time falls by about 40%). The fusions' HLO differs, the
# dots and collectives do not. Set before jax starts its backend;
# subprocesses inherit them. A test marked ``optimized`` runs in a fresh
# process with XLA's defaults, the compiler users run (a module's such tests
# in one process): one that compares two
# different programs bit for bit (their floating-point contractions are
# LLVM's), and one that checks casts to the fnuz float8 formats or to
# float4, which the older emitters round otherwise (a tiny negative value
# becomes float8_e5m2fnuz's NaN; some float4 ties round the other way).
_OPTIMIZED_RUN = "QBITS_TEST_OPTIMIZED"


def _jaxlib_version() -> tuple[int, ...]:
    """The installed jaxlib's (major, minor), read without starting jax."""
    from importlib.metadata import version

    return tuple(int(p) for p in version("jaxlib").split(".")[:2])


# XLA:CPU also splits each program's LLVM module to compile the parts on
# threads: for the suite's small programs, on workers that already use every
# core, that is overhead (a third of the compile's CPU time); one part a
# program emits the same code.
_FAST_COMPILE = (
    "--xla_backend_optimization_level=0",
    "--xla_cpu_parallel_codegen_split_count=1",
)
# jaxlib 0.11's XLA has only the newer emitters and aborts on a flag it does
# not know.
if _jaxlib_version() < (0, 11):
    _FAST_COMPILE += ("--xla_cpu_use_fusion_emitters=false",)
if not os.environ.get(_OPTIMIZED_RUN):
    os.environ["XLA_FLAGS"] = " ".join(
        (os.environ.get("XLA_FLAGS", ""), *_FAST_COMPILE)
    ).strip()

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import settings

import qbits

# Scripts that are run, not imported: the fixture writers need the reference
# libraries (aqtp, torch, bitsandbytes, compressed-tensors, transformers'
# Flax models), the others set XLA_FLAGS for a subprocess with 8 devices.
collect_ignore = [
    "tests/data/make_aqt_golden.py",
    "tests/data/make_bnb_optim.py",
    "tests/data/make_flax_checkpoints.py",
    "tests/data/make_more_checkpoints.py",
    "tests/data/make_quantized_checkpoints.py",
    "tests/data/reference_read.py",
    "tests/ops/sharded_check.py",
    "tests/ops/shard_map_check.py",
]

settings.register_profile("ci", max_examples=10, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=300, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _strict_dtype_promotion():
    with jax.numpy_dtype_promotion("strict"):
        yield


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace):
    doctest_namespace.update(qbits=qbits, jax=jax, jnp=jnp, np=np)


def pytest_configure(config):
    """Registers the ``optimized`` marker."""
    config.addinivalue_line(
        "markers",
        "optimized: a claim about the program users compile (two programs "
        "bit for bit, fnuz float8 or float4 casts); runs with XLA's default "
        "flags, in a fresh process",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Keeps a module's ``optimized`` tests on one xdist worker.

    They run there in one fresh process (see :func:`pytest_pyfunc_call`), so a
    module pays for one start of jax and its fixtures once.
    """
    for item in items:
        if item.get_closest_marker("optimized") and not item.get_closest_marker(
            "xdist_group"
        ):
            item.add_marker(pytest.mark.xdist_group(f"optimized:{item.path.name}"))


def _plain_nodeid(nodeid: str) -> str:
    """A node id without xdist's ``@group`` suffix."""
    if nodeid.rfind("@") > nodeid.rfind("]"):
        return nodeid[: nodeid.rfind("@")]
    return nodeid


# Outcomes of the optimized runs: module path -> {node id: [outcome, text]}.
_optimized_outcomes: dict[str, dict[str, list[str]]] = {}


def _run_optimized(item) -> dict[str, list[str]]:
    """Runs the module's selected ``optimized`` tests in one fresh process."""
    selected = [
        _plain_nodeid(other.nodeid)
        for other in item.session.items
        if other.path == item.path and other.get_closest_marker("optimized")
    ]
    flags = os.environ.get("XLA_FLAGS", "").split()
    flags = " ".join(flag for flag in flags if flag not in _FAST_COMPILE)
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "outcomes.json")
        env = {**os.environ, _OPTIMIZED_RUN: report, "XLA_FLAGS": flags}
        command = [sys.executable, "-m", "pytest", *selected, "-n", "0",
                   "-p", "no:cacheprovider", "--no-header", "-q"]  # fmt: skip
        result = subprocess.run(
            command, cwd=item.config.rootpath, env=env, capture_output=True,
            text=True, timeout=900,
        )  # fmt: skip
        outcomes = {}
        if os.path.exists(report):
            with open(report) as f:
                outcomes = json.load(f)
    # A test the run never reached (a crash, a collection error) fails with
    # the run's whole output.
    missed = ["failed", f"{result.stdout}{result.stderr}"]
    return {nodeid: outcomes.get(nodeid, missed) for nodeid in selected}


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Runs an ``optimized`` test in a fresh process with XLA's defaults.

    The first of a module's ``optimized`` tests runs them all there; the rest
    read their outcomes.
    """
    if os.environ.get(_OPTIMIZED_RUN) or not pyfuncitem.get_closest_marker("optimized"):
        return None
    module = str(pyfuncitem.path)
    if module not in _optimized_outcomes:
        _optimized_outcomes[module] = _run_optimized(pyfuncitem)
    outcome, text = _optimized_outcomes[module][_plain_nodeid(pyfuncitem.nodeid)]
    if outcome == "failed":
        pytest.fail(f"with XLA's default flags:\n{text}", pytrace=False)
    if outcome == "skipped":
        pytest.skip(text)
    return True


# In an optimized run: node id -> [outcome, text], for the parent.
_reported: dict[str, list[str]] = {}


def pytest_runtest_logreport(report):
    """In an optimized run, records each test's outcome for the parent."""
    if not os.environ.get(_OPTIMIZED_RUN):
        return
    nodeid = _plain_nodeid(report.nodeid)
    if report.failed:
        text = _reported.get(nodeid, ["", ""])[1]
        _reported[nodeid] = ["failed", f"{text}{report.when}: {report.longreprtext}\n"]
    elif report.skipped:
        _reported.setdefault(nodeid, ["skipped", str(report.longrepr[-1])])
    elif report.when == "call":
        _reported.setdefault(nodeid, ["passed", ""])


def pytest_sessionfinish(session):
    """In an optimized run, writes the outcomes where the parent reads them."""
    target = os.environ.get(_OPTIMIZED_RUN)
    if target and target != "1":
        with open(target, "w") as f:
            json.dump(_reported, f)
