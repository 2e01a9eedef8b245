"""The figures ``kvtb bench`` reports: their keys, units and goals, and one measured figure.

:data:`GOALS` is the one list of keys (``results.json`` has exactly these, plus the peer's
with ``--peer``); each carries the goal the speed work aims at, or none where no goal was
set (then ``met`` is ``None``). A figure whose section could not run still appears, with
``value`` ``None`` and the reason in ``note``. Pure: no processes.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from testbed.bench.stats import Ratio, Spread


@dataclass(frozen=True)
class Goal:
    compare: Literal["<=", ">=", "=="] | None
    target: float | bool | None
    unit: str
    """``×`` for ratios, or the value's unit."""

    def text(self) -> str:
        if self.compare is None:
            return "—"
        if isinstance(self.target, bool):
            return "true" if self.target else "false"
        return f"{'≤' if self.compare == '<=' else '≥'} {_number(self.target)}{_suffix(self.unit)}"

    def met(self, value: Any) -> bool | None:
        if self.compare is None or value is None:
            return None
        if isinstance(value, dict):  # every sub-value must meet it
            verdicts = [self.met(v) for v in value.values() if v is not None]
            return all(verdicts) if verdicts else None
        compare: Callable[[Any, Any], bool] = {
            "<=": operator.le,
            ">=": operator.ge,
            "==": operator.eq,
        }[self.compare]
        return bool(compare(value, self.target))


_NONE_SET = Goal(None, None, "×")
GOALS: dict[str, Goal] = {
    "replay_vs_bare_scheduler": Goal("<=", 2.0, "×"),
    "replay_metadata_only_vs_bare_scheduler": Goal("<=", 1.3, "×"),
    "tracing_overhead": Goal("<=", 1.10, "×"),
    "spans_overhead": Goal("<=", 1.05, "×"),
    "chunk_log_overhead": _NONE_SET,
    "loader_spans_per_s": Goal(">=", 2_000_000, "spans/s"),
    "store_vs_memcpy": Goal(">=", 0.8, "×"),
    "retrieve_vs_memcpy": Goal(">=", 0.8, "×"),
    "rpc_round_trip_ms": Goal("<=", 1.0, "ms"),
    "rpc_transit_ms": Goal("<=", 0.2, "ms"),
    "first_pass_vs_recompute_1k": Goal("<=", 1.05, "×"),
    "first_pass_mirror_vs_recompute_1k": Goal("<=", 1.02, "×"),
    "first_pass_mirror_vs_recompute_4k": Goal("<=", 1.02, "×"),
    "first_pass_mirror_vs_recompute_16k": Goal("<=", 1.02, "×"),
    "hit_1k_vs_recompute": Goal("<=", 0.5, "×"),
    "hit_4k_vs_recompute": _NONE_SET,
    "hit_16k_vs_recompute": _NONE_SET,
    "hit_1k_over_prefix_cache_ms": Goal("<=", 0.5, "ms"),
    "disk_tier_write_vs_dd": _NONE_SET,
    "disk_tier_read_vs_dd": _NONE_SET,
    "promotion_vs_memcpy": _NONE_SET,
    "scale_1m_wall_s": Goal("<=", 3600.0, "s"),
    "scale_1m_peak_rss_bytes": Goal("<=", 4 * 2**30, "bytes"),
    "scale_fleet16_wall_s": Goal("<=", 600.0, "s"),
    "scale_agentic_whatif_wall_s": Goal("<=", 300.0, "s"),
    "scale_agentic_peak_rss_bytes": Goal("<=", 4 * 2**30, "bytes"),
}
PEER_GOALS: dict[str, Goal] = {
    "lookup_vs_lmcache": _NONE_SET,
    "store_vs_lmcache": _NONE_SET,
    "retrieve_vs_lmcache": _NONE_SET,
    "hit_tokens_equal_to_lmcache": Goal("==", True, ""),
    "outputs_identical": Goal("==", True, ""),
}


def goal_of(key: str) -> Goal:
    return GOALS.get(key) or PEER_GOALS[key]


Value = float | bool | dict[str, float | None] | None


@dataclass
class Figure:
    key: str
    value: Value
    what: str
    """Exactly what was timed, and against what."""
    ratio: Ratio | None = None
    spread: Spread | None = None
    """The value's own spread where it is not a ratio (e.g. spans/s, ms)."""
    details: dict[str, Any] = field(default_factory=dict)
    note: str | None = None
    """Why there is no value, or a caveat."""

    def __post_init__(self) -> None:
        goal_of(self.key)  # raises KeyError for a key that is not reported

    @classmethod
    def of(cls, key: str, ratio: Ratio, what: str, **extra: Any) -> Figure:
        """The figure whose value is ``ratio`` (its median over median), with its samples."""
        return cls(key, ratio.value, what, ratio=ratio, **extra)

    def to_dict(self) -> dict[str, Any]:
        goal = goal_of(self.key)
        out: dict[str, Any] = {
            "value": _rounded(self.value),
            "unit": goal.unit,
            "goal": goal.text(),
            "met": goal.met(self.value),
            "what": self.what,
        }
        if self.ratio is not None:
            out["numerator"] = self.ratio.numerator.to_dict()
            out["denominator"] = self.ratio.denominator.to_dict()
            out["paired_ratio"] = self.ratio.paired.to_dict(4)
        if self.spread is not None:
            out["spread"] = self.spread.to_dict(4)
        if self.details:
            out["details"] = self.details
        if self.note:
            out["note"] = self.note
        return out


def missing(key: str, what: str, reason: str) -> Figure:
    """A figure that could not be measured in this run."""
    return Figure(key, None, what, note=reason)


def _rounded(value: Value) -> Value:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: None if v is None else round(v, 4) for k, v in value.items()}
    return value


def _number(value: float | bool | None) -> str:
    if isinstance(value, float) and not value.is_integer():
        return f"{value:g}"
    return f"{int(value or 0):,}"


def _suffix(unit: str) -> str:
    return unit if unit == "×" else f" {unit}" if unit else ""


def merge(figures: list[Figure]) -> dict[str, Figure]:
    """One figure per key: parts measured by different sections (e.g. a peer comparison of
    the servers alone and inside vLLM, whose values are dicts) joined into one."""
    merged: dict[str, Figure] = {}
    for figure in figures:
        first = merged.get(figure.key)
        if first is None:
            merged[figure.key] = figure
            continue
        if first.value is None or figure.value is None:  # one part could not be measured
            kept, lost = (figure, first) if first.value is None else (first, figure)
            notes = "; ".join(n for n in (kept.note, lost.note) if n) or None
            merged[figure.key] = Figure(
                kept.key, kept.value, kept.what, kept.ratio, kept.spread, kept.details, notes
            )
            continue
        if not (isinstance(first.value, dict) and isinstance(figure.value, dict)):
            raise ValueError(f"two figures for {figure.key} that are not parts of one")
        merged[figure.key] = Figure(
            figure.key,
            {**first.value, **figure.value},
            "; ".join(w for w in (first.what, figure.what) if w),
            ratio=first.ratio or figure.ratio,
            details={**first.details, **figure.details},
            note="; ".join(n for n in (first.note, figure.note) if n) or None,
        )
    return merged
