"""Shared helpers: timing rounds and printing medians with their spread."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` took."""
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def spread(samples: list[float]) -> str:
    """The interquartile range of ``samples`` (seconds) in ms, for the noise."""
    if len(samples) < 4:
        return "n/a"
    q1, _, q3 = statistics.quantiles(samples, n=4)
    return f"{q1 * 1e3:.3f}–{q3 * 1e3:.3f}"


def table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    widths = [max(len(str(r[i])) for r in [list(header), *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)
