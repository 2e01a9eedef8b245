"""``results.json`` and the markdown of BENCHMARKS.md from one ``kvtb bench`` run. Pure."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from testbed.bench.config import Table
from testbed.bench.figures import GOALS, PEER_GOALS, Figure, merge
from testbed.bench.machine import describe_load, is_loaded

RESULTS = "results.json"
MARKDOWN = "BENCHMARKS.md"


def document(
    figures: list[Figure],
    tables: list[Table],
    *,
    run: dict[str, Any],
    machine: dict[str, Any],
    versions: dict[str, Any],
    load: dict[str, Any],
    sections: dict[str, Any],
) -> dict[str, Any]:
    """The results document: every key of :data:`GOALS` (and of the peer's with ``--peer``)
    at the top level, beside the run, the machine, its load and the detail tables."""
    keys = list(GOALS) + (list(PEER_GOALS) if run.get("peer") else [])
    by_key = merge(figures)
    out: dict[str, Any] = {}
    for key in keys:
        figure = by_key.get(key)
        out[key] = (figure or Figure(key, None, "", note="its section did not run")).to_dict()
    out["run"] = run
    out["machine"] = machine
    out["versions"] = versions
    out["load"] = load
    out["sections"] = sections
    out["tables"] = [
        {
            "title": t.title,
            "header": list(t.header),
            "rows": [list(map(str, r)) for r in t.rows],
            "note": t.note,
        }
        for t in tables
    ]
    return out


def write(out_dir: Path, doc: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / RESULTS).write_text(json.dumps(doc, indent=1, default=str) + "\n")
    (out_dir / MARKDOWN).write_text(markdown(doc))


def markdown(doc: dict[str, Any]) -> str:
    run, load = doc["run"], doc["load"]
    lines = ["# Benchmarks", ""]
    if is_loaded(load):
        lines += [
            f"> **Provisional: measured on a loaded machine** ({describe_load(load)}). These "
            "figures show that the command works; they are not evidence of speed.",
            "",
        ]
    lines += [
        f"`{run['command']}`: {run['wall_s'] / 60:.1f} min"
        + (
            f", of which {run['peer_env_s']:.0f} s creating the peer environment"
            if run.get("peer_env_s")
            else ""
        )
        + f", {run['finished']}.",
        "",
        "## Results",
        "",
        "| key | value | goal | met | spread | what was measured |",
        "|---|---:|---|:-:|---|---|",
    ]
    for key, entry in doc.items():
        if isinstance(entry, dict) and "goal" in entry:
            lines.append(
                f"| `{key}` | {_value(entry)} | {entry['goal']} | {_met(entry['met'])} | "
                f"{_spread(entry)} | {entry['what']}{_note(entry)} |"
            )
    lines += ["", "## Machine and load", ""]
    machine = doc["machine"]
    lines.append(
        f"- {machine['cpu_model']}, {machine['cpus']} CPUs, {machine['memory_gib']} GiB; "
        f"{machine['platform']}; Python {machine['python']}"
    )
    lines.append(f"- whole run: {describe_load(load)}")
    for name, section in doc["sections"].items():
        status = f"failed: {section['error']}" if section.get("error") else "ok"
        section_load = describe_load(section["load"]) if section.get("load") else ""
        lines.append(
            f"- `{name}` ({section['load'].get('wall_s', 0):.0f} s, {status}): {section_load}"
        )
    lines += ["", "## Versions", ""]
    lines += [f"- {name}: {value}" for name, value in doc["versions"].items() if value]
    for table in doc["tables"]:
        lines += ["", f"## {table['title']}", ""]
        if table["note"]:
            lines += [table["note"], ""]
        if table["rows"]:  # a table of text only (a module's printed output) has none
            lines.append("| " + " | ".join(table["header"]) + " |")
            lines.append("|" + "---|" * len(table["header"]))
            lines += ["| " + " | ".join(row) + " |" for row in table["rows"]]
    return "\n".join(lines) + "\n"


def _value(entry: dict[str, Any]) -> str:
    value = entry["value"]
    if value is None:
        return "–"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        return "<br>".join(f"{k}: {_number(v)}" for k, v in value.items())
    return _number(value)


def _number(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def _met(met: bool | None) -> str:
    return "–" if met is None else "✓" if met else "✗"


def _spread(entry: dict[str, Any]) -> str:
    paired = entry.get("paired_ratio") or entry.get("spread")
    if not paired:
        return ""
    return f"{_number(paired['min'])}–{_number(paired['max'])} (n={paired['n']})"


def _note(entry: dict[str, Any]) -> str:
    return f" ({entry['note']})" if entry.get("note") else ""
