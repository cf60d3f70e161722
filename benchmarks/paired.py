"""Paired, interleaved timing shared by the benchmarks.

Each round runs every variant a few times back to back (keeping the fastest,
which filters out preemption) and divides by the baseline's time from the
same round, so that machine noise hits all variants alike; a figure is the
median of these per-round ratios, with its interquartile range.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


def measure(
    runs: dict[str, Callable[[], Any]], rounds: int, reps: int
) -> dict[str, list[float]]:
    """Best-of-``reps`` seconds of each run, one entry per round."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            best = float("inf")
            for _ in range(reps):
                start = time.perf_counter()
                jax.block_until_ready(run())
                best = min(best, time.perf_counter() - start)
            times[name].append(best)
    return times


def ratio_stats(times: list[float], base: list[float]) -> dict[str, Any]:
    """Median milliseconds, median ratio to ``base`` and the ratio's IQR."""
    ratios = sorted(t / b for t, b in zip(times, base, strict=True))
    q1, q3 = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
    return {
        "ms": round(statistics.median(times) * 1e3, 3),
        "time_ratio": round(statistics.median(ratios), 3),
        "time_ratio_iqr": [round(q1, 3), round(q3, 3)],
    }


def machine(benchmark: str, model: str, rounds: int, reps: int) -> dict[str, Any]:
    """The ``meta`` entry of a benchmark's JSON."""
    return {
        "benchmark": benchmark,
        "model": model,
        "rounds": rounds,
        "reps_per_round": reps,
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": str(jax.devices()[0].device_kind),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
    }
