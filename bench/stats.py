"""Timing helpers: medians of repeated runs, and the formatting every table shares.

Medians, not means: a 2-core CI machine has noisy neighbours, and one descheduled run
should not move a result. Warm-up runs are discarded so first-call costs (imports, page
faults, lazy initialisation) are not charged to either side of a comparison.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def progress(text: str) -> None:
    """One line on stderr: the run takes minutes and should say where it is."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """Seconds taken by one call of ``fn``, and its result."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def median_time(fn: Callable[[], object], repeat: int, warmup: int = 1) -> float:
    """Median seconds of ``repeat`` calls of ``fn`` after ``warmup`` discarded calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(max(1, repeat)):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def interleaved_medians(
    fns: dict[str, Callable[[], object]],
    repeat: int,
    warmup: int = 1,
    before_round: Callable[[], object] | None = None,
) -> dict[str, float]:
    """Median seconds of each of ``fns`` over ``repeat`` rounds that call each once in
    turn (after ``warmup`` such rounds, discarded): when two engines are compared, a slow
    spell of a shared machine then falls on both rather than on whichever ran during it.
    ``before_round``, untimed, starts every round (the warm-up's too)."""
    for _ in range(warmup):
        if before_round is not None:
            before_round()
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(max(1, repeat)):
        if before_round is not None:
            before_round()
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def median(values: list[float]) -> float:
    return statistics.median(values)


def ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator``, or NaN when the denominator is zero."""
    return numerator / denominator if denominator else float("nan")


def fmt_ratio(value: float) -> str:
    if value != value:  # NaN
        return "n/a"
    if value >= 100:
        return f"{value:,.0f}x"
    if value >= 10:
        return f"{value:.1f}x"
    return f"{value:.2f}x"


def fmt_num(value: float, digits: int = 3) -> str:
    """A number with ``digits`` significant digits and thousands separators."""
    if value != value:
        return "n/a"
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 10 ** (digits - 1):
        return f"{value:,.0f}"
    decimals = digits - 1 - int(f"{magnitude:e}".split("e")[1])
    return f"{value:,.{max(0, decimals)}f}"


def fmt_ms(seconds: float) -> str:
    return fmt_num(seconds * 1_000) + " ms"
