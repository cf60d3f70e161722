"""Start ``examples/sharded_lm.py`` as N processes on this machine's CPU.

The N processes (``jax.distributed``, ``--cpu-devices`` host devices each,
process 0 the coordinator on a free local port) and, beside them, the same
training as one process over all the devices. Waits for all of them, then
prints each step's loss of every run side by side and checks them: the
processes of the N-process run agree bit for bit (the loss is one
replicated value), the N-process run equals the one-process run, and each
run's training resumed from its checkpoint repeats its own losses::

    python examples/sharded_lm_launch.py                      # 2 x 4 vs 1 x 8
    python examples/sharded_lm_launch.py --processes 4 -- --config fp8_delayed

Arguments after ``--`` go to every ``sharded_lm.py`` process. A process
that fails, a port in use or a run past ``--timeout`` ends all of them
with a one-line message (exit status 1). ``--json`` prints the records
instead of the table (``benchmarks/multiprocess.py`` writes them to
``benchmarks/results/multiprocess_cpu.*``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

SCRIPT = pathlib.Path(__file__).with_name("sharded_lm.py")


class LaunchError(Exception):
    """Why a launch failed, in one line."""


def free_port(port: int = 0) -> int:
    """``port`` if it is free on this machine (any free one for 0)."""
    with socket.socket() as s:
        try:
            s.bind(("localhost", port))
        except OSError as e:
            raise LaunchError(
                f"port {port} is in use ({e.strerror}): pick another --port, "
                "or leave it out for a free one"
            ) from None
        return s.getsockname()[1]


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    # The exception line, not the traceback's last frame or gloo's chatter.
    errors = [ln for ln in lines if "Error" in ln.split(":")[0] or "error:" in ln]
    return (errors or lines or ["(no output)"])[-1][:300]


def run_all(runs: dict[str, list[list[str]]], timeout: float, workdir: str) -> dict:
    """Starts every process of every run, waits, returns each run's records.

    ``runs`` maps a run's name to the argument lists of its processes. The
    first process to fail, or the timeout, stops all of them.
    """
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(SCRIPT.parents[1]), env.get("PYTHONPATH")) if p
    )
    procs = {}
    for name, commands in runs.items():
        for i, argv in enumerate(commands):
            out = open(f"{workdir}/{name}.{i}.out", "w+")  # noqa: SIM115
            err = open(f"{workdir}/{name}.{i}.err", "w+")  # noqa: SIM115
            cmd = [sys.executable, str(SCRIPT), *argv]
            procs[name, i] = (subprocess.Popen(cmd, stdout=out, stderr=err, env=env),
                              out, err)  # fmt: skip
    deadline = time.monotonic() + timeout
    try:
        while True:
            running = [k for k, (p, _, _) in procs.items() if p.poll() is None]
            for (name, i), (p, _, err) in procs.items():
                if p.returncode not in (None, 0):
                    err.seek(0)
                    what = f"{name} run, process {i}"
                    raise LaunchError(
                        f"{what} exited with status {p.returncode}: "
                        f"{_last_line(err.read())}"
                    )
            if not running:
                break
            if time.monotonic() > deadline:
                names = ", ".join(f"{n} run's process {i}" for n, i in running)
                raise LaunchError(
                    f"timed out after {timeout:g} s ({names} still running)"
                )
            time.sleep(0.2)
    finally:
        for p, out, err in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
            out.close()
            err.close()
    records: dict[str, list[dict]] = {}
    for name, i in procs:
        text = pathlib.Path(f"{workdir}/{name}.{i}.out").read_text()
        try:
            records.setdefault(name, []).append(json.loads(text.splitlines()[-1]))
        except (IndexError, json.JSONDecodeError):
            raise LaunchError(f"{name} run, process {i} printed no record") from None
    return records


def compare(one: dict, many: list[dict]) -> dict:
    """Checks and summarises the runs' losses (raises LaunchError on a mismatch)."""
    for r in many[1:]:
        if r["losses"] != many[0]["losses"]:
            raise LaunchError(
                f"process {r['process']}'s losses differ from process 0's: "
                f"{r['losses']} vs {many[0]['losses']}"
            )
    for r in (one, *many):
        if r["resumed_losses"] != r["losses"][r["checkpoint_step"] :]:
            raise LaunchError(
                f"{r['processes']}-process run, process {r['process']}: training "
                f"resumed from the checkpoint gives {r['resumed_losses']}, not "
                f"{r['losses'][r['checkpoint_step'] :]}"
            )
    a, b = one["losses"], many[0]["losses"]
    worst = max(abs(x - y) / max(abs(x), 1e-30) for x, y in zip(a, b, strict=True))
    # float32's unit roundoff 2**-24 per operation; a loss is a reduction
    # over thousands of terms, its order set by the collectives.
    if worst > 1e-5:
        raise LaunchError(
            f"{len(many)}-process losses differ from the one-process run's by "
            f"up to {worst:.2e} (relative): {b} vs {a}"
        )
    return {"bit_equal": a == b, "max_relative_difference": worst}


def launch(
    worker: list[str],
    processes: int = 2,
    devices: int = 8,
    port: int = 0,
    timeout: float = 600,
) -> dict:
    """Runs ``sharded_lm.py`` as ``processes`` processes and as one; compares.

    Returns ``{"one_process": record, "processes": [record, ...],
    "bit_equal": ..., "max_relative_difference": ..., "seconds": ...}``
    (a record is the JSON line a process prints). Raises LaunchError.
    """
    n = processes
    port = free_port(port)
    with tempfile.TemporaryDirectory(prefix="sharded_lm_") as tmp:
        many = [
            [*worker, "--cpu-devices", str(devices // n),
             "--num-processes", str(n), "--process-id", str(i),
             "--coordinator", f"localhost:{port}", "--timeout", str(int(timeout)),
             "--checkpoint-dir", f"{tmp}/ckpt_many"]
            for i in range(n)
        ]  # fmt: skip
        one = [*worker, "--cpu-devices", str(devices),
               "--checkpoint-dir", f"{tmp}/ckpt_one"]  # fmt: skip
        start = time.perf_counter()
        names = (f"{n}-process", "1-process")
        records = run_all(dict(zip(names, (many, [one]), strict=True)), timeout, tmp)
        seconds = round(time.perf_counter() - start, 1)
    one_r, many_r = records[names[1]][0], records[names[0]]
    summary = compare(one_r, many_r)
    return {"one_process": one_r, "processes": many_r, **summary, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--devices", type=int, default=8, help="devices in all")
    p.add_argument("--port", type=int, default=0, help="coordinator port (0: any free)")
    p.add_argument("--timeout", type=float, default=600, help="seconds, all runs")
    p.add_argument("--json", action="store_true", help="print the records as JSON")
    p.add_argument("worker", nargs="*", help="arguments for sharded_lm.py (after --)")
    args = p.parse_args(argv)
    n = args.processes
    if n < 2 or args.devices % n:
        p.error(f"--devices {args.devices} must split over --processes {n} >= 2")
    try:
        result = launch(args.worker, n, args.devices, args.port, args.timeout)
    except LaunchError as e:
        print(f"sharded_lm_launch: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
    else:
        print(markdown(result))
        print(f"({result['seconds']} s for all {n + 1} processes)")
    return 0


def markdown(result: dict) -> str:
    """The losses of every run side by side, and what the comparison found."""
    one, many = result["one_process"], result["processes"]
    n, d = len(many), many[0]["local_devices"]
    head = [f"1 process x {one['devices']} devices"]
    head += [f"{n} processes x {d}: process {r['process']}" for r in many]
    lines = ["| step | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    for s, loss in enumerate(one["losses"]):
        cells = [f"{loss:.7f}", *(f"{r['losses'][s]:.7f}" for r in many)]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    k = one["checkpoint_step"]
    equal = (
        "bit for bit"
        if result["bit_equal"]
        else f"within {result['max_relative_difference']:.1e} (relative)"
    )
    lines += [
        "",
        f"`{one['config']}`, mesh {one['mesh']}: the {n}-process losses equal the "
        f"one-process run's {equal}; every run, restored from its step-{k} "
        f"checkpoint, repeats steps {k}-{len(one['losses']) - 1} bit for bit.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
