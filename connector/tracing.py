"""Tracing for the connector inside vLLM's processes, where no kvtestbed entry point runs.

vLLM creates the connector in its scheduler and worker processes; those processes trace for
kvtestbed only if someone installs the OpenTelemetry SDK there. :func:`acquire` does, on the
first connector of a process, when the connector is told where spans go:

- ``kvtb.span_dir`` (or ``KVTB_SPAN_DIR``): OTLP JSON lines in ``<dir>/spans/``, as a run
  directory holds them (point it at the ``--run-dir`` of ``kvtb server`` and the directory
  is a complete run: the connector's spans, the server's spans and its chunk log);
- the standard ``OTEL_*`` variables asking for OTLP export (``OTEL_EXPORTER_OTLP_ENDPOINT``,
  ``OTEL_TRACES_EXPORTER=otlp``): the stock exporters, e.g. to Jaeger.

A process whose entry point already installed kvtestbed's tracing (the testbed's own engines)
is left alone; without a destination the connector uses the process's global provider (vLLM's
own, when it was started with ``--otlp-traces-endpoint``) or traces nothing. The last
connector of the process to shut down flushes and closes what :func:`acquire` installed.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from testbed.core import telemetry
from testbed.core.telemetry import attributes as a
from testbed.core.telemetry.setup import Tracing, TracingConfig, configure_tracing, otlp_exporter

SPAN_DIR_ENV = "KVTB_SPAN_DIR"
"""Environment variable: where the connector writes its spans (``kvtb.span_dir``)."""

_lock = threading.Lock()
_installed: Tracing | None = None
_users = 0


def acquire(
    span_dir: str, *, run_id: str, service_name: str, rank: int | None, resource: dict
) -> bool:
    """Installs tracing for this process if the connector is told where spans go; True if
    this connector holds a reference (it then calls :func:`release` at its shutdown)."""
    global _installed, _users
    with _lock:
        if _installed is not None:
            _users += 1
            return True
        if telemetry.installed():
            return False  # an entry point of ours traces this process already
        directory = span_dir or os.environ.get(SPAN_DIR_ENV, "")
        if not directory and otlp_exporter() is None:
            return False
        _installed = configure_tracing(
            TracingConfig(
                service_name=service_name,
                run_dir=Path(directory) if directory else None,
                run_id=run_id,
                rank=rank,
                resource={a.ENGINE: "vllm-server", **resource},
                # vLLM may stop these processes without shutting the connector down.
                synchronous=True,
                # With a span directory, the OTEL_* variables are vLLM's own (its tracing).
                otlp_from_env=not directory,
            )
        )
        if _installed is None:  # OTEL_SDK_DISABLED
            return False
        _users = 1
        return True


def release() -> None:
    """One connector fewer; the last one flushes and closes the tracing it installed."""
    global _installed, _users
    with _lock:
        _users -= 1
        if _users > 0 or _installed is None:
            if _installed is not None:
                _installed.force_flush()
            return
        _installed.shutdown()
        _installed = None
