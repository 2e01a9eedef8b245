"""Chaos results: the keys every scenario reports, their totals, the acceptance verdict, and
``reliability.json`` / ``reliability.md``. Pure: no processes.

Every scenario reports the same :data:`KEYS` (``None`` where a key does not apply, e.g. no
engine ran); totals add counts and take the maximum of :data:`MAX_KEYS`. A scenario may also
state *checks*, claims particular to it ("summary.json was written", "the second run hit"),
which must all hold.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KEYS = (
    "requests_total",
    "requests_completed",
    "integrity_errors",
    "server_crashes",
    "max_step_stall_s",
    "leaked_locks",
    "leaked_pins",
    "leaked_inflight",
    "leaked_shm_files",
    "fuzz_frames",
    "fuzz_crashes",
    "capacity_violations",
    "max_server_rss_mib",
    "recovery_s",
    "unauthorized_accepted",
    "sigbus_deaths",
    "pool_refusals",
    "spans_dropped",
    "chunk_events_dropped",
    "unauthenticated_closed",
    "max_connect_wait_s",
    "quota_refusals",
    "starved_requests",
)
MAX_KEYS = ("max_step_stall_s", "max_server_rss_mib", "recovery_s", "max_connect_wait_s")
ZERO_KEYS = (
    "integrity_errors",
    "server_crashes",
    "leaked_locks",
    "leaked_pins",
    "leaked_inflight",
    "leaked_shm_files",
    "fuzz_crashes",
    "capacity_violations",
    "unauthorized_accepted",
    "sigbus_deaths",
    "starved_requests",
)
"""Keys that must total 0."""

Value = int | float | None


@dataclass
class ScenarioResult:
    name: str
    proves: str
    values: dict[str, Value] = field(default_factory=lambda: dict.fromkeys(KEYS))
    checks: dict[str, bool] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    error: str | None = None
    """What stopped the scenario before it finished (it then fails)."""
    skipped: str | None = None
    """Why the scenario could not run on this machine (e.g. no private mount namespaces);
    it then neither passes nor fails, and the report says so."""

    def set(self, **values: Value) -> None:
        unknown = set(values) - set(KEYS)
        if unknown:
            raise KeyError(f"not chaos keys: {sorted(unknown)}")
        self.values.update(values)

    def add(self, **values: int) -> None:
        for key, value in values.items():
            self.set(**{key: int(self.values[key] or 0) + value})

    def maximum(self, **values: float | None) -> None:
        for key, value in values.items():
            if value is not None:
                current = self.values[key]
                self.set(**{key: value if current is None else max(float(current), value)})

    @property
    def passed(self) -> bool:
        """Its checks hold, its zero keys are 0 and every request it made was answered."""
        v = self.values
        return (
            self.error is None
            and all(self.checks.values())
            and not any(v[key] for key in ZERO_KEYS)
            and v["requests_completed"] == v["requests_total"]
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "proves": self.proves,
            "passed": self.passed,
            "wall_s": round(self.wall_s, 2),
            **self.values,
            "checks": self.checks,
            "details": self.details,
            "error": self.error,
            "skipped": self.skipped,
        }


def totals(results: list[ScenarioResult]) -> dict[str, Value]:
    out: dict[str, Value] = {}
    for key in KEYS:
        values = [float(v) for r in results if (v := r.values[key]) is not None]
        if not values:
            out[key] = None
        elif key in MAX_KEYS:
            out[key] = max(values)
        else:
            out[key] = int(sum(values))
    return out


def failures(results: list[ScenarioResult], timeout_s: float) -> list[str]:
    """Why the run does not pass the acceptance criteria (empty: it passes)."""
    total = totals(results)
    found = []
    if total["requests_completed"] != total["requests_total"]:
        found.append(
            f"requests_completed {total['requests_completed']} != requests_total "
            f"{total['requests_total']}"
        )
    found += [f"{key} is {total[key]}, not 0" for key in ZERO_KEYS if total[key]]
    stall = total["max_step_stall_s"]
    if stall is not None and float(stall) > timeout_s + 1.0:
        found.append(f"max_step_stall_s {stall:.2f} exceeds the timeout {timeout_s:g} s + 1 s")
    for result in results:
        if result.error is not None:
            found.append(f"{result.name}: stopped by {result.error}")
        found += [
            f"{result.name}: {name} does not hold" for name, ok in result.checks.items() if not ok
        ]
    return found


def write_reports(
    out_dir: Path, results: list[ScenarioResult], *, settings: dict[str, Any]
) -> dict[str, Any]:
    """Writes ``reliability.json`` and ``reliability.md``; returns the JSON document."""
    problems = failures(results, float(settings["timeout_s"]))
    document = {
        "kvtb_chaos": 1,
        **settings,
        "passed": not problems,
        "failures": problems,
        "totals": totals(results),
        "scenarios": [r.to_dict() for r in results],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "reliability.json").write_text(json.dumps(document, indent=1, default=str))
    (out_dir / "reliability.md").write_text(markdown(document))
    return document


def markdown(document: dict[str, Any]) -> str:
    """The reliability report: a verdict, a table of scenarios, a table of their keys."""
    scenarios = document["scenarios"]
    verdict = "**passed**" if document["passed"] else "**FAILED**"
    mode = "quick" if document.get("quick") else "full"
    lines = [
        "# Reliability run",
        "",
        f"`kvtb chaos` ({mode}, seed {document.get('seed')}, connector timeout "
        f"{document.get('timeout_s')} s): {verdict} in {document.get('wall_s', 0):.0f} s.",
        "",
    ]
    lines += [f"- {problem}" for problem in document["failures"]]
    lines += ["", "| scenario | what it proves | checks |", "|---|---|---|"]
    for s in scenarios:
        checks = ", ".join(f"{name} {'✓' if ok else '✗'}" for name, ok in s["checks"].items())
        if s["error"]:
            checks += f" (stopped: {s['error'][:120]})"
        if s.get("skipped"):
            checks = f"skipped: {s['skipped']}"
        lines.append(f"| {s['name']} | {s['proves']} | {checks} |")
    names = [s["name"] for s in scenarios]
    lines += ["", "| key | " + " | ".join(names) + " | total |"]
    lines.append("|---|" + "---:|" * (len(names) + 1))
    for key in KEYS:
        cells = [_cell(s[key]) for s in scenarios] + [_cell(document["totals"][key])]
        lines.append(f"| `{key}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(value: Value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)
