"""Start ``examples/sharded_lm.py`` as N processes on this machine's CPU.

The N processes (``jax.distributed``, ``--cpu-devices`` host devices each,
process 0 the coordinator on a free local port, gloo collectives) and,
beside them, the same training as one process over all the devices: once
as a ``jax.distributed`` job of one process (gloo collectives too) and
once without (XLA's in-process collectives). Waits for all of them, then
prints each step's loss of every run side by side and checks them: the
processes of the N-process run agree bit for bit (the loss is one
replicated value), the N-process run equals the one-process job's bit for
bit, and each run's training resumed from its checkpoint repeats its own
losses. The in-process run's losses are shown beside them, not checked:
its collectives sum in another order, a difference of float32 rounding
that quantization's rounding to a grid amplifies::

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
                    how = (
                        f"was killed by signal {-p.returncode}"
                        if p.returncode < 0
                        else f"exited with status {p.returncode}"
                    )
                    raise LaunchError(f"{what} {how}: {_last_line(err.read())}")
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


def _relative(a: list[float], b: list[float]) -> list[float]:
    return [abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)]


def compare(one: dict, many: list[dict]) -> None:
    """Raises LaunchError unless the runs' losses agree bit for bit."""
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
    if many[0]["losses"] != one["losses"]:
        worst = max(_relative(many[0]["losses"], one["losses"]))
        raise LaunchError(
            f"{len(many)}-process losses differ from the one-process run's by up "
            f"to {worst:.2e} (relative): {many[0]['losses']} vs {one['losses']}"
        )


def launch(
    worker: list[str],
    processes: int = 2,
    devices: int = 8,
    port: int = 0,
    timeout: float = 600,
    in_process: bool = True,
) -> dict:
    """Runs ``sharded_lm.py`` as ``processes`` processes and as one; compares.

    The one-process run is a ``jax.distributed`` job of one process, so that
    its collectives are gloo's too: it must equal the N processes bit for
    bit. With ``in_process``, also the one-process run without
    ``jax.distributed`` (XLA's own collectives between the devices of a
    process, which sum in another order): its losses are reported, not
    checked.

    Returns ``{"one_process": record, "processes": [record, ...],
    "in_process": record, "in_process_relative_difference": [per step],
    "seconds": ...}`` (a record is the JSON line a process prints). Raises
    LaunchError.
    """
    n = processes
    ports = [free_port(port), free_port()]
    with tempfile.TemporaryDirectory(prefix="sharded_lm_") as tmp:

        def job(name, i, count, port):
            return [*worker, "--cpu-devices", str(devices // count),
                    "--num-processes", str(count), "--process-id", str(i),
                    "--coordinator", f"localhost:{port}",
                    "--timeout", str(int(timeout)), "--checkpoint-dir",
                    f"{tmp}/{name}"]  # fmt: skip

        names = (f"{n}-process", "1-process", "1-process in-process")
        runs = {
            names[0]: [job("many", i, n, ports[0]) for i in range(n)],
            names[1]: [job("one", 0, 1, ports[1])],
        }
        if in_process:
            runs[names[2]] = [[*worker, "--cpu-devices", str(devices),
                               "--checkpoint-dir", f"{tmp}/local"]]  # fmt: skip
        start = time.perf_counter()
        records = run_all(runs, timeout, tmp)
        seconds = round(time.perf_counter() - start, 1)
    one, many = records[names[1]][0], records[names[0]]
    compare(one, many)
    result = {"one_process": one, "processes": many, "seconds": seconds}
    if in_process:
        local = records[names[2]][0]
        compare(local, [local])  # its own checkpoint
        result["in_process"] = local
        result["in_process_relative_difference"] = _relative(
            local["losses"], one["losses"]
        )
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--devices", type=int, default=8, help="devices in all")
    p.add_argument("--port", type=int, default=0, help="coordinator port (0: any free)")
    p.add_argument("--timeout", type=float, default=600, help="seconds, all runs")
    p.add_argument("--json", action="store_true", help="print the records as JSON")
    p.add_argument(
        "--no-in-process",
        action="store_true",
        help="leave out the one-process run without jax.distributed",
    )
    p.add_argument("worker", nargs="*", help="arguments for sharded_lm.py (after --)")
    args = p.parse_args(argv)
    n = args.processes
    if n < 2 or args.devices % n:
        p.error(f"--devices {args.devices} must split over --processes {n} >= 2")
    try:
        local = not args.no_in_process
        result = launch(args.worker, n, args.devices, args.port, args.timeout, local)
    except LaunchError as e:
        print(f"sharded_lm_launch: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
    else:
        print(markdown(result))
        print(f"({result['seconds']} s for all the processes)")
    return 0


def markdown(result: dict) -> str:
    """The losses of every run side by side, and what the comparison found."""
    one, many = result["one_process"], result["processes"]
    local = result.get("in_process")
    n, d = len(many), many[0]["local_devices"]
    head = [f"{n} processes x {d}: process {r['process']}" for r in many]
    head += [f"1 process x {one['devices']}"]
    columns = [r["losses"] for r in (*many, one)]
    if local:
        head += ["1 x 8, in-process collectives", "relative difference"]
        columns += [local["losses"], result["in_process_relative_difference"]]
    lines = ["| step | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    for s in range(len(one["losses"])):
        cells = [f"{c[s]:.7f}" for c in columns]
        if local:
            cells[-1] = f"{columns[-1][s]:.1e}"
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    k = one["checkpoint_step"]
    lines += [
        "",
        f"`{one['config']}`, mesh {one['mesh']}: the {n} processes' losses equal "
        "the one-process run's bit for bit (gloo collectives in both); every "
        f"run, restored from its step-{k} checkpoint, repeats steps "
        f"{k}-{len(one['losses']) - 1} bit for bit.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
