"""A run's spans as Jaeger-UI JSON (the "upload JSON" format of the Jaeger UI).

``{"data": [{"traceID", "spans": [...], "processes": {...}}]}``: one entry per trace; spans
carry ``operationName``, ``references`` (``CHILD_OF`` the parent, ``FOLLOWS_FROM`` each
link), ``startTime``/``duration`` in microseconds, typed ``tags`` (attributes, span kind,
status) and ``logs`` (span events); ``processes`` name the service, rank and pid. References
to spans that are not in the run are dropped (and counted in a ``warnings`` entry), so every
reference in the file resolves.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from testbed.analysis.spans import BASE_COLUMNS, load_events, load_spans

_KIND_TAG = {"SERVER": "server", "CLIENT": "client", "PRODUCER": "producer", "CONSUMER": "consumer"}


def tag(key: str, value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"key": key, "type": "bool", "value": value}
    if isinstance(value, int):
        return {"key": key, "type": "int64", "value": value}
    if isinstance(value, float):
        return {"key": key, "type": "float64", "value": value}
    if isinstance(value, list | tuple):
        return {"key": key, "type": "string", "value": json.dumps(list(value))}
    return {"key": key, "type": "string", "value": str(value)}


def _present(value: Any) -> bool:
    if value is None or value is pd.NA:
        return False
    return not (isinstance(value, float) and math.isnan(value))


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


def to_jaeger(spans: pd.DataFrame, events: pd.DataFrame | None = None) -> dict[str, Any]:
    """The Jaeger-UI document for ``spans`` (a :func:`load_spans` frame) and their events."""
    known = set(spans["span_id"])
    attribute_columns = [
        c for c in spans.columns if c not in BASE_COLUMNS and not c.startswith("resource.")
    ]
    logs = _logs(events)
    traces: dict[str, dict[str, Any]] = {}
    dropped = 0
    for row in spans.to_dict("records"):
        trace = traces.setdefault(
            row["trace_id"], {"traceID": row["trace_id"], "spans": [], "processes": {}}
        )
        process_id = _process(trace["processes"], row)
        references = []
        if row["parent_span_id"]:
            if row["parent_span_id"] in known:
                references.append(
                    {
                        "refType": "CHILD_OF",
                        "traceID": row["trace_id"],
                        "spanID": row["parent_span_id"],
                    }
                )
            else:
                dropped += 1
        for link in row["links"] or []:
            link_trace, link_span = link.split(":")
            if link_span in known:
                references.append(
                    {"refType": "FOLLOWS_FROM", "traceID": link_trace, "spanID": link_span}
                )
            else:
                dropped += 1
        tags = [tag(c, _plain(row[c])) for c in attribute_columns if _present(row[c])]
        if row["kind"] in _KIND_TAG:
            tags.append(tag("span.kind", _KIND_TAG[row["kind"]]))
        if row["status"] != "UNSET":
            tags.append(tag("otel.status_code", row["status"]))
        if row["status"] == "ERROR":
            tags.append(tag("error", True))
            if row["status_message"]:
                tags.append(tag("otel.status_description", row["status_message"]))
        start_us = int(row["start_time"].value // 1000)
        trace["spans"].append(
            {
                "traceID": row["trace_id"],
                "spanID": row["span_id"],
                "operationName": row["name"],
                "references": references,
                "startTime": start_us,
                "duration": max(0, int(row["end_time"].value // 1000) - start_us),
                "tags": tags,
                "logs": logs.get(row["span_id"], []),
                "processID": process_id,
                "warnings": None,
                "flags": 1,
            }
        )
    warnings = [f"{dropped} references to spans outside this run were dropped"] if dropped else None
    return {
        "data": [{**trace, "warnings": warnings} for trace in traces.values()],
        "total": 0,
        "limit": 0,
        "offset": 0,
        "errors": None,
    }


def _process(processes: dict[str, Any], row: dict[str, Any]) -> str:
    rank = row.get("rank")
    service = row.get("service") or "unknown"
    tags = [tag("kvcache.run_id", row.get("run_id") or "")]
    if rank is not None and _present(rank):
        tags.append(tag("kvcache.rank", int(rank)))
    pid = row.get("resource.process.pid")
    if pid is not None and _present(pid):
        tags.append(tag("process.pid", int(pid)))
    candidate = {"serviceName": service, "tags": tags}
    for process_id, process in processes.items():
        if process == candidate:
            return process_id
    process_id = f"p{len(processes) + 1}"
    processes[process_id] = candidate
    return process_id


def _logs(events: pd.DataFrame | None) -> dict[str, list[dict[str, Any]]]:
    if events is None or events.empty:
        return {}
    fixed = {"trace_id", "span_id", "span_name", "event", "time"}
    fields = [c for c in events.columns if c not in fixed]
    logs: dict[str, list[dict[str, Any]]] = {}
    for row in events.to_dict("records"):
        entry_fields = [tag("event", row["event"])]
        entry_fields += [tag(c, _plain(row[c])) for c in fields if _present(row[c])]
        logs.setdefault(row["span_id"], []).append(
            {"timestamp": int(row["time"].value // 1000), "fields": entry_fields}
        )
    return logs


def export_jaeger(run_dirs: Iterable[Path | str], output: Path) -> int:
    """Writes the Jaeger JSON of one or more runs to ``output``; returns the span count."""
    run_dirs = list(run_dirs)
    spans = pd.concat([load_spans(d) for d in run_dirs], ignore_index=True, sort=False)
    events = pd.concat([load_events(d) for d in run_dirs], ignore_index=True, sort=False)
    document = to_jaeger(spans, events)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(document))
    return len(spans)
