"""Whether a run's record can be trusted: the failures a finished run's summary lists.

A run writes ``summary.json`` even when something went wrong on the way (its server died, the
telemetry is incomplete), so that what it recorded can be read. Such a run is *failed*: its
summary lists why in ``failures``, ``kvtb run`` exits with 1, a sweep records it as failed, and
it is never reused: the next run of the same spec redoes it (:func:`testbed.run.failure`). A
run whose process died or raised has no summary and is redone too; one a sweep saw fail has
``error.txt`` beside whatever it wrote.

The checks (each one sentence in ``failures``):

- integrity errors: KV blocks whose content was wrong;
- dropped spans: the telemetry, which is the record, is incomplete;
- the cache server stopped answering during the run (``server_available_after`` false);
- the run's own cache server wrote no spans into the run directory (while the run traced);
- the telemetry holds fewer requests than the engine served while every trace was to be
  recorded (a sampled run records some requests by design: its summary's ``sampling`` says so).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from testbed.core.run_dir import RunDir

SERVER_SERVICE = "kvtb-server"


def failures(summary: Mapping[str, Any], run_dir: Path, *, own_server: bool) -> list[str]:
    """Why the run of ``summary`` cannot be trusted (empty: it can). ``own_server``: the run
    started its cache server (so its spans belong in ``run_dir``)."""
    found = []
    errors = summary.get("integrity_errors")
    if errors:
        found.append(f"{errors} KV blocks failed the integrity check")
    dropped = summary.get("spans_dropped")
    if dropped:
        found.append(f"{dropped} spans were dropped: the run's telemetry is incomplete")
    if summary.get("server_available_after") is False:
        found.append("the cache server stopped answering during the run")
    traced = bool(summary.get("spans_exported"))
    if (
        own_server
        and traced
        and not any((spans := RunDir(Path(run_dir)).spans).glob(f"{SERVER_SERVICE}-*.jsonl"))
    ):
        found.append(
            f"the run's cache server wrote no spans into {spans}: its telemetry is missing"
        )
    every_trace = (summary.get("sampling") or {}).get("every_trace", True)
    served, recorded = summary.get("requests"), summary.get("requests_recorded")
    if every_trace and served is not None and recorded is not None and recorded < served:
        found.append(f"the telemetry records {recorded} of the {served} requests the engine served")
    return found
