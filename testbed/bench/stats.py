"""Samples, their spread, and cells measured side by side. Pure: no processes, no I/O.

Every ratio the bench reports comes from :func:`interleave`: the cells of one comparison run
in turn within each round (A B A B ...), so a burst of load on the machine falls on both
sides alike; the ratio is the ratio of the medians, and the spread of the per-round ratios
says how much to trust it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Spread:
    """Order statistics of a sample (in its own unit)."""

    n: int
    min: float
    q1: float
    median: float
    q3: float
    max: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Spread:
        if not samples:
            raise ValueError("no samples")
        values = sorted(samples)
        if len(values) >= 2:
            q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
        else:
            q1 = q3 = values[0]
        return cls(len(values), values[0], q1, statistics.median(values), q3, values[-1])

    def scaled(self, factor: float) -> Spread:
        """The same spread in another unit (``factor`` > 0, e.g. 1e3 for s → ms)."""
        return Spread(
            self.n, *(v * factor for v in (self.min, self.q1, self.median, self.q3, self.max))
        )

    def to_dict(self, digits: int = 6) -> dict[str, float | int]:
        return {k: v if k == "n" else round(v, digits) for k, v in asdict(self).items()}

    def text(self, fmt: str = "{:.3g}") -> str:
        """``median (min–max)``."""
        return f"{fmt.format(self.median)} ({fmt.format(self.min)}–{fmt.format(self.max)})"


Cell = Callable[[], float]
"""One measurement: runs once and returns the seconds it timed (set-up left out)."""


def interleave(
    cells: Mapping[str, Cell],
    rounds: int,
    *,
    warmup: int = 0,
    on_round: Callable[[int], None] | None = None,
) -> dict[str, list[float]]:
    """``rounds`` rounds of every cell in turn (A B A B ...); the samples of each cell.
    ``warmup`` rounds run first and are not recorded; ``on_round(i)`` after each round."""
    if rounds < 1:
        raise ValueError(f"rounds must be positive, got {rounds}")
    samples: dict[str, list[float]] = {name: [] for name in cells}
    for index in range(warmup + rounds):
        for name, cell in cells.items():
            elapsed = cell()
            if index >= warmup:
                samples[name].append(elapsed)
        if on_round is not None:
            on_round(index)
    return samples


@dataclass(frozen=True)
class Ratio:
    """``numerator`` over ``denominator`` measured side by side."""

    value: float
    """Median of the numerator over the median of the denominator."""
    numerator: Spread
    denominator: Spread
    paired: Spread
    """The ratio of each round's pair: its spread is the ratio's noise."""

    @classmethod
    def of(cls, numerator: Sequence[float], denominator: Sequence[float]) -> Ratio:
        pairs = [n / d for n, d in zip(numerator, denominator, strict=False) if d > 0]
        num, den = Spread.of(numerator), Spread.of(denominator)
        return cls(num.median / den.median, num, den, Spread.of(pairs or [float("nan")]))

    def inverted(self) -> Ratio:
        """Denominator over numerator (e.g. speed relative to memcpy instead of time)."""
        paired = self.paired
        flipped = [1 / v for v in (paired.max, paired.q3, paired.median, paired.q1, paired.min)]
        return Ratio(
            self.denominator.median / self.numerator.median,
            self.denominator,
            self.numerator,
            Spread(paired.n, *flipped),
        )
