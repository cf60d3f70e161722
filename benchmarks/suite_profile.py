"""Where the test suite's time goes: CPU and XLA compiles per test file.

Runs the test command (``python -m pytest``, xdist and all, as ``.ci/run``
does) with this file loaded as a pytest plugin in every worker. The plugin
records, per test: the CPU seconds of its process (children included, so a
subprocess test counts its subprocess), its wall seconds, and from JAX's
monitoring events the number of XLA compiles and the seconds spent
compiling, lowering jaxprs to MLIR and tracing. Each worker appends JSON
lines to a folder; this script sums them per test file (doctests by module)
and writes a JSON file and a markdown table of the files that cost most.

Compile counts do not depend on the machine's load; seconds do (the
monitoring durations are wall time). Use the counts to find what to trim,
the suite's own ``/usr/bin/time`` for how long it takes.

Run: python benchmarks/suite_profile.py --json OUT.json [--md OUT.md]
     [--top 25] [-- PYTEST ARGS]
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import pathlib
import platform
import resource
import subprocess
import sys
import tempfile
import time

_DIR = "QBITS_SUITE_PROFILE_DIR"
_KEYS = ("cpu", "wall", "compiles", "compile", "lower", "trace")
_now: dict[str, float] = {}


def _on_duration(event: str, seconds: float, **_: object) -> None:
    for suffix, key in (
        ("backend_compile_duration", "compile"),
        ("jaxpr_to_mlir_module_duration", "lower"),
        ("jaxpr_trace_duration", "trace"),
    ):
        if event.endswith(suffix):
            _now[key] = _now.get(key, 0.0) + seconds
            if key == "compile":
                _now["compiles"] = _now.get("compiles", 0) + 1


def _cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def pytest_configure(config: object) -> None:
    """Listens to JAX's compile, lowering and tracing durations."""
    if os.environ.get(_DIR):
        import jax

        jax.monitoring.register_event_duration_secs_listener(_on_duration)


def pytest_runtest_protocol(item: object, nextitem: object) -> None:
    """Starts a test's counters (the test runs after this hook)."""
    _now.clear()
    _now.update(cpu0=_cpu(), wall0=time.perf_counter())


def pytest_runtest_logfinish(nodeid: str, location: object) -> None:
    """Appends the finished test's record to this worker's file."""
    folder = os.environ.get(_DIR)
    if not folder or "cpu0" not in _now:
        return
    record = {
        "id": nodeid,
        "cpu": _cpu() - _now["cpu0"],
        "wall": time.perf_counter() - _now["wall0"],
        **{k: _now.get(k, 0) for k in ("compiles", "compile", "lower", "trace")},
    }
    with open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def _summary(folder: str, top: int) -> dict:
    records = [
        json.loads(line)
        for path in glob.glob(os.path.join(folder, "*.jsonl"))
        for line in pathlib.Path(path).read_text().splitlines()
    ]
    files: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in records:
        name = r["id"].split("::")[0]
        for k in _KEYS:
            files[name][k] += r[k]
        files[name]["tests"] += 1
    total = {k: round(sum(r[k] for r in records), 1) for k in _KEYS}
    rows = sorted(files.items(), key=lambda kv: -kv[1]["cpu"])[:top]
    return {
        "tests": len(records),
        "total": total,
        "files": [
            {"file": f, **{k: round(v, 2) for k, v in c.items()}} for f, c in rows
        ],
    }


def _markdown(s: dict, machine: str) -> str:
    t = s["total"]
    lines = [
        f"The test suite per file, {machine}: {s['tests']} tests, "
        f"{t['cpu']:.0f} s CPU, {t['compiles']:.0f} XLA compiles (compile "
        f"{t['compile']:.0f} s, lowering {t['lower']:.0f} s, tracing "
        f"{t['trace']:.0f} s: wall seconds, load-dependent).",
        "",
        "| file | tests | CPU s | compiles | compile s | lower s | trace s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in s["files"]:
        lines.append(
            f"| {r['file']} | {r['tests']:.0f} | {r['cpu']:.1f} | "
            f"{r['compiles']:.0f} | {r['compile']:.1f} | {r['lower']:.1f} | "
            f"{r['trace']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def _cpu_model() -> str:
    """The CPU's model name (Linux), else the machine type."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="the JSON file to write")
    parser.add_argument("--md", help="also write the markdown table here")
    parser.add_argument("--top", type=int, default=25, help="files in the table")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's")
    args = parser.parse_args()
    root = pathlib.Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as folder:
        here = str(pathlib.Path(__file__).resolve().parent)
        path = os.pathsep.join(filter(None, (here, os.environ.get("PYTHONPATH"))))
        env = {**os.environ, _DIR: folder, "PYTHONPATH": path}
        command = [sys.executable, "-m", "pytest", "-p", "suite_profile",
                   "-p", "no:cacheprovider", *args.pytest_args]  # fmt: skip
        run = subprocess.run(command, cwd=root, env=env)
        summary = _summary(folder, args.top)
    summary["pytest_exit_status"] = run.returncode
    machine = f"{_cpu_model()}, {os.cpu_count()} cores"
    summary["machine"] = machine
    pathlib.Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    table = _markdown(summary, machine)
    if args.md:
        pathlib.Path(args.md).write_text(table)
    print(table)


if __name__ == "__main__":
    main()
