"""Spans as Jaeger-UI JSON (the "upload JSON" format of the Jaeger UI), for runs and sweeps.

``{"data": [{"traceID", "spans": [...], "processes": {...}, "warnings"}]}``: one entry per trace.
A span carries ``operationName``, ``references`` (``CHILD_OF`` its parent first, as the UI takes
the first reference as the parent; then ``FOLLOWS_FROM`` each link), ``startTime``/``duration``
in microseconds, typed ``tags`` (attributes, span kind, status) and ``logs`` (span events).

Made to navigate, not only to render:

- a *process* is one process of one run, fleet instance and TP rank: its tags are the run's
  resource attributes (``kvcache.run_id``, ``kvcache.instance``, ``kvcache.rank``,
  ``process.pid``, engine, workload, chunk size, TP size, MLA, policy, capacity, ... : every
  ``resource.*`` column of :func:`testbed.analysis.load_spans`), so runs of one export (a
  sweep) are told apart, and so are the instances of a fleet and their ranks, which share
  one OS process (``service.instance.id`` ``"<instance>.<rank>"``, see
  :func:`service_instance_id`);
- a trace's root span is titled with the request it serves, e.g.
  ``kvcache.request chat-00017 · conv-00003`` (the UI names a trace after its root span). Only
  the export says so: the OTel span names stay low-cardinality;
- :func:`select_requests` keeps only the traces of given request ids.

References to spans that are not in the export are dropped (and counted in a ``warnings``
entry), so every reference in the file resolves.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from testbed.analysis.spans import BASE_COLUMNS, load_events, load_spans
from testbed.core.telemetry import attributes as a

_KIND_TAG = {"SERVER": "server", "CLIENT": "client", "PRODUCER": "producer", "CONSUMER": "consumer"}
_RESOURCE = "resource."
TITLE_SEPARATOR = " · "


def tag(key: str, value: Any) -> dict[str, Any]:
    """A Jaeger key/value with its type (``bool``, ``int64``, ``float64``, ``string``)."""
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
        c for c in spans.columns if c not in BASE_COLUMNS and not c.startswith(_RESOURCE)
    ]
    processes = _Processes([c for c in spans.columns if c.startswith(_RESOURCE)])
    logs = _logs(events)
    traces: dict[str, dict[str, Any]] = {}
    dropped = 0
    for row in spans.to_dict("records"):
        trace_id = row["trace_id"]
        trace = traces.setdefault(trace_id, {"traceID": trace_id, "spans": [], "processes": {}})
        process_id = processes.id_in(trace, row)
        references, num_dropped = _references(row, known)
        dropped += num_dropped
        parent = row["parent_span_id"]
        start_us = int(row["start_time"].value // 1000)
        trace["spans"].append(
            {
                "traceID": trace_id,
                "spanID": row["span_id"],
                "operationName": row["name"] if parent and parent in known else _title(row),
                "references": references,
                "startTime": start_us,
                "duration": max(0, int(row["end_time"].value // 1000) - start_us),
                "tags": _span_tags(row, attribute_columns),
                "logs": logs.get(row["span_id"], []),
                "processID": process_id,
                "warnings": None,
                "flags": 1,
            }
        )
    warnings = [f"{dropped} references to spans outside this export were dropped"]
    return {
        "data": [{**trace, "warnings": warnings if dropped else None} for trace in traces.values()],
        "total": 0,
        "limit": 0,
        "offset": 0,
        "errors": None,
    }


class _Processes:
    """The processes of one export: each process (:func:`_process_key`) made once
    (:func:`_process`), and named ``p1``, ``p2``, ... in each trace in the order its spans
    first come from it."""

    def __init__(self, resource_columns: Sequence[str]) -> None:
        self._resource_columns = resource_columns
        self._made: dict[tuple[Any, ...], tuple[str, list[dict[str, Any]]]] = {}
        self._ids: dict[tuple[str, tuple[Any, ...]], str] = {}

    def id_in(self, trace: dict[str, Any], row: dict[str, Any]) -> str:
        """The id in ``trace`` of the process of span ``row``; a process new to the trace is
        added to its ``processes``."""
        key = _process_key(row)
        if key not in self._made:
            self._made[key] = _process(row, self._resource_columns)
        process_id = self._ids.get((trace["traceID"], key))
        if process_id is None:
            process_id = f"p{len(trace['processes']) + 1}"
            self._ids[(trace["traceID"], key)] = process_id
            service, tags = self._made[key]
            trace["processes"][process_id] = {"serviceName": service, "tags": tags}
        return process_id


def _references(row: dict[str, Any], known: set[str]) -> tuple[list[dict[str, Any]], int]:
    """Span ``row``'s references to spans in ``known``: ``CHILD_OF`` its parent first, then
    ``FOLLOWS_FROM`` each link; and how many it had to spans not in ``known`` (dropped)."""
    references = []
    dropped = 0
    parent = row["parent_span_id"]
    if parent and parent in known:
        references.append({"refType": "CHILD_OF", "traceID": row["trace_id"], "spanID": parent})
    elif parent:
        dropped += 1
    for link in row["links"] or []:
        link_trace, link_span = link.split(":")
        if link_span in known:
            references.append(
                {"refType": "FOLLOWS_FROM", "traceID": link_trace, "spanID": link_span}
            )
        else:
            dropped += 1
    return references, dropped


def _span_tags(row: dict[str, Any], attribute_columns: Sequence[str]) -> list[dict[str, Any]]:
    """Span ``row``'s attributes that have a value, then its kind and its status (an error
    also as ``error``, with its description where it has one)."""
    tags = [tag(c, _plain(row[c])) for c in attribute_columns if _present(row[c])]
    if row["kind"] in _KIND_TAG:
        tags.append(tag("span.kind", _KIND_TAG[row["kind"]]))
    if row["status"] != "UNSET":
        tags.append(tag("otel.status_code", row["status"]))
    if row["status"] == "ERROR":
        tags.append(tag("error", True))
        if row["status_message"]:
            tags.append(tag("otel.status_description", row["status_message"]))
    return tags


def _title(row: dict[str, Any]) -> str:
    """A root span's operation name: its name, the request id and group where it has them."""
    parts = [row["name"]]
    request_id, group = row.get(a.REQUEST_ID), row.get(a.REQUEST_GROUP)
    if request_id is not None and _present(request_id):
        parts.append(f" {request_id}")
        if group is not None and _present(group):
            parts.append(f"{TITLE_SEPARATOR}{group}")
    return "".join(parts)


def _process_key(row: dict[str, Any]) -> tuple[Any, ...]:
    rank, instance = row.get("rank"), row.get(a.INSTANCE)
    pid = row.get("resource.process.pid")
    return (
        row.get("service"),
        row.get("run_id"),
        int(instance) if instance is not None and _present(instance) else None,
        int(rank) if rank is not None and _present(rank) else None,
        int(pid) if pid is not None and _present(pid) else None,
    )


def service_instance_id(instance: int | None, rank: int | None) -> str | None:
    """A process's ``service.instance.id`` in the export: ``"<rank>"`` (a TP rank's worker),
    ``"<instance>"`` (a fleet instance's scheduler side) or ``"<instance>.<rank>"`` (a rank
    of a fleet instance); ``None`` for a process that is neither (a cache server)."""
    if instance is None:
        return None if rank is None else str(rank)
    return str(instance) if rank is None else f"{instance}.{rank}"


def _process(row: dict[str, Any], resource_columns: Sequence[str]) -> tuple[str, list[Any]]:
    """(service name, tags): the run id, the fleet instance, the rank and every resource
    attribute of the row's process (the row's ``resource.*`` values: each process's own
    resource); a fleet's instances and ranks, which run in one process, are one process each
    (:func:`service_instance_id`)."""
    service, run_id, instance, rank, _ = _process_key(row)
    tags = []
    if run_id is not None and _present(run_id):
        tags.append(tag("kvcache.run_id", run_id))
    if instance is not None:
        tags.append(tag(a.INSTANCE, instance))
    if rank is not None:
        tags.append(tag("kvcache.rank", rank))
    instance_id = service_instance_id(instance, rank)
    if instance_id is not None:
        tags.append(tag(a.SERVICE_INSTANCE_ID, instance_id))
    for column in resource_columns:
        value = row[column]
        name = column.removeprefix(_RESOURCE)
        if _present(value) and not (name == a.SERVICE_INSTANCE_ID and instance_id is not None):
            tags.append(tag(name, _plain(value)))
    return service or "unknown", tags


def _logs(events: pd.DataFrame | None) -> dict[str, list[dict[str, Any]]]:
    if events is None or events.empty:
        return {}
    fixed = {"trace_id", "span_id", "span_name", "event", "time", "run_id"}
    fields = [c for c in events.columns if c not in fixed]
    logs: dict[str, list[dict[str, Any]]] = {}
    for row in events.to_dict("records"):
        entry_fields = [tag("event", row["event"])]
        entry_fields += [tag(c, _plain(row[c])) for c in fields if _present(row[c])]
        logs.setdefault(row["span_id"], []).append(
            {"timestamp": int(row["time"].value // 1000), "fields": entry_fields}
        )
    return logs


def select_requests(spans: pd.DataFrame, request_ids: Iterable[str]) -> pd.DataFrame:
    """The spans of every trace in which a span names one of ``request_ids``: as its
    ``kvcache.request_id``, in its ``kvcache.request_ids``, or as the request part of a session
    id (``kvcache.session_id(s)``: ``"{engine_id}:{request_id}"``; a whole session id matches
    too). That is the request's own trace and the traces of batches that served it."""
    wanted = set(request_ids)

    def names(value: Any) -> bool:
        if isinstance(value, str):
            return value in wanted or value.rpartition(":")[2] in wanted
        if isinstance(value, list | tuple):
            return any(names(item) for item in value)
        return False

    mentioned = pd.Series(False, index=spans.index)
    for column in (a.REQUEST_ID, a.REQUEST_IDS, a.SESSION_ID, a.SESSION_IDS):
        if column in spans:
            mentioned |= spans[column].map(names).astype(bool)
    traces = set(spans.loc[mentioned, "trace_id"])
    if not traces:
        raise ValueError(f"no span names request {', '.join(sorted(wanted))}")
    return spans[spans["trace_id"].isin(traces)].reset_index(drop=True)


def export_jaeger(
    paths: Iterable[Path | str], output: Path, *, request_ids: Sequence[str] | None = None
) -> int:
    """Writes the Jaeger JSON of the runs under ``paths`` (run or sweep directories, see
    :func:`testbed.analysis.spans.run_dirs`) to ``output``; with ``request_ids``, only those
    requests' traces (:func:`select_requests`). Returns the number of spans written."""
    paths = list(paths)
    spans = pd.concat([load_spans(p) for p in paths], ignore_index=True, sort=False)
    events = pd.concat([load_events(p) for p in paths], ignore_index=True, sort=False)
    if request_ids:
        spans = select_requests(spans, request_ids)
        events = events[events["span_id"].isin(set(spans["span_id"]))]
    document = to_jaeger(spans, events)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(document))
    return len(spans)
