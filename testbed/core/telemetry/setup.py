"""Installing the OpenTelemetry SDK in an entry point (server, engine, CLI). Not for libraries.

:func:`configure_tracing` builds a tracer provider (the span recorder,
:mod:`testbed.core.telemetry.recorder`, unless ``TracingConfig.recorder`` is off: then the SDK's
own, :mod:`testbed.core.telemetry.sdk_provider`) whose resource names the process, its TP rank
and the run, and whose exporters are

- OTLP JSON lines in ``<run_dir>/spans/<service>-<pid>.jsonl`` (the default, embedded);
- OTLP over gRPC or HTTP/protobuf to Jaeger or any collector, when ``otlp_endpoint`` is given
  or the standard variables ask for it (``OTEL_TRACES_EXPORTER=otlp``,
  ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``, ``..._PROTOCOL`` = ``grpc`` | ``http/protobuf``).

``OTEL_SDK_DISABLED=true`` turns tracing off; ``OTEL_TRACES_SAMPLER[_ARG]`` and
``OTEL_BSP_*`` are honoured. Queues default to sizes at which a normal run drops nothing, and
nothing is dropped silently: every span that ends is counted, every exporter counts what it
delivered, and :meth:`Tracing.shutdown` (flush, then close) writes both counts next to the
span file, where the run summary reads ``spans_exported`` and ``spans_dropped``. The counts
file gets its space when tracing starts and is rewritten in place, so the counts of spans a
full disk made drop can still be written (with the first error, ``errors``).
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import INVALID_SPAN_ID, INVALID_TRACE_ID

from testbed.core import telemetry
from testbed.core.run_dir import SPANS_DIR
from testbed.core.telemetry import attributes as a
from testbed.core.telemetry.recorder import RecorderProvider
from testbed.core.telemetry.row_span import RowBatch
from testbed.core.telemetry.sampling import make_sampler, sampler_from_environment
from testbed.core.telemetry.sdk_provider import EndCounter, sdk_provider
from testbed.core.telemetry.span_file import JsonLinesSpanExporter

COUNTS_SUFFIX = ".counts.json"
COLLECTED_PREFIX = "collected-"
"""Span files an OTLP collector of the run writes (``collected-<pid>.jsonl``; they may repeat
spans that a process also wrote to its own file)."""
COUNTS_BYTES = 4096
"""Space of a counts file, reserved when tracing starts (the record is padded to it)."""


@dataclass(frozen=True)
class TracingConfig:
    service_name: str
    """``service.name``: kvtb-server, kvtb-engine, ..."""
    run_dir: Path | None = None
    """Where ``spans/`` goes; ``None``: no span files."""
    run_id: str = ""
    rank: int | None = None
    """TP rank of a worker process (``service.instance.id``)."""
    resource: Mapping[str, Any] = field(default_factory=dict)
    """More resource attributes (model, chunk size, TP size, workload, ...)."""
    otlp_endpoint: str | None = None
    """Also export over OTLP to this endpoint (else: only if the OTEL_* variables say so)."""
    otlp_protocol: str | None = None
    """``grpc`` or ``http/protobuf``; default from the variables, else ``grpc``."""
    otlp_from_env: bool = True
    """Whether the ``OTEL_*`` variables may add an OTLP exporter (off where they belong to
    someone else: vLLM sets them for its own tracing in its processes)."""
    synchronous: bool = False
    """Write every span to its file as it ends and keep the counts file current, for processes
    that may be stopped without a shutdown (vLLM's engine and worker processes)."""
    sampling: tuple[str, float | None] | None = None
    """The trace sampler, ``(name, ratio)`` as :mod:`testbed.core.telemetry.sampling` names it;
    ``None``: what the ``OTEL_TRACES_SAMPLER*`` variables say, read as that module reads them."""
    recorder: bool = True
    """Record spans as rows and build the SDK's spans at export
    (:mod:`testbed.core.telemetry.recorder`); ``False``: the SDK's own tracer provider and
    batch processors (the same spans, at the SDK's cost per span)."""


class SystemIdGenerator(IdGenerator):
    """Trace and span ids from a generator of this process's own, seeded from the operating
    system's randomness (and seeded again in a forked child). The SDK's default draws them
    from Python's global ``random``, which vLLM seeds (``--seed``) in its processes: every
    process would then make the same ids. Drawing each id from the operating system instead
    costs a system call per span."""

    def __init__(self) -> None:
        self._random = _process_random()

    def generate_span_id(self) -> int:
        span_id = self._random.getrandbits(64)
        while span_id == INVALID_SPAN_ID:
            span_id = self._random.getrandbits(64)
        return span_id

    def generate_trace_id(self) -> int:
        trace_id = self._random.getrandbits(128)
        while trace_id == INVALID_TRACE_ID:
            trace_id = self._random.getrandbits(128)
        return trace_id


_random: random.Random | None = None


def _process_random() -> random.Random:
    """This process's id generator (created on first use, seeded again after a fork)."""
    global _random
    if _random is None:
        _random = random.Random(os.urandom(32))
        os.register_at_fork(after_in_child=lambda: _process_random().seed(os.urandom(32)))
    return _random


class _CountingExporter(SpanExporter):
    def __init__(self, name: str, inner: SpanExporter) -> None:
        self.name = name
        self.inner = inner
        self.exported = 0
        self.failed = 0
        self.error: str | None = None
        """Why an export failed, the first time (``None``: none did)."""
        self.after_export: Callable[[], None] | None = None
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return self._counted(lambda: self.inner.export(spans), len(spans))

    def _counted(self, export: Callable[[], SpanExportResult], count: int) -> SpanExportResult:
        error = None
        try:
            result = export()
        except Exception as exc:
            result, error = SpanExportResult.FAILURE, f"{type(exc).__name__}: {exc}"
        with self._lock:
            if result is SpanExportResult.SUCCESS:
                self.exported += count
            else:
                self.failed += count
                self.error = self.error or error or getattr(self.inner, "first_error", None)
        if self.after_export is not None:
            self.after_export()
        return result

    @property
    def writes_rows(self) -> bool:
        """Whether the exporter takes the recorder's rows (``export_rows``)."""
        return bool(getattr(self.inner, "writes_rows", False))

    def export_rows(self, batch: RowBatch) -> SpanExportResult:
        return self._counted(lambda: self.inner.export_rows(batch), len(batch))  # type: ignore[attr-defined]

    @property
    def delivered(self) -> int:
        """Spans the exporter took and did not lose later (a span file's pending lines)."""
        return self.exported - int(getattr(self.inner, "lost_spans", 0))

    def shutdown(self) -> None:
        self.inner.shutdown()
        self.error = self.error or getattr(self.inner, "first_error", None)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self.inner.force_flush(timeout_millis)


def _stamp_instance(attributes: dict[str, Any]) -> None:
    """The recorder's instance stamp (the SDK provider's ``InstanceStamp``): the fleet
    instance of a span that starts."""
    instance = telemetry.current_instance.get()
    if instance is not None:
        attributes[a.INSTANCE] = instance


class Tracing:
    """The installed SDK of one process. :meth:`shutdown` flushes everything (idempotent)."""

    def __init__(
        self,
        config: TracingConfig,
        exporters: Mapping[str, SpanExporter],
        span_file: Path | None = None,
    ) -> None:
        self.config = config
        resource_attributes: dict[str, Any] = {
            a.SERVICE_NAME: config.service_name,
            a.RUN_ID: config.run_id,
            "process.pid": os.getpid(),
            **config.resource,
        }
        if config.rank is not None:
            resource_attributes[a.SERVICE_INSTANCE_ID] = str(config.rank)
            resource_attributes[a.RANK] = config.rank
        resource = Resource.create(resource_attributes)
        sampler = (
            make_sampler(*config.sampling)
            if config.sampling is not None
            else sampler_from_environment()
        )
        self.exporters = {name: _CountingExporter(name, e) for name, e in exporters.items()}
        self.span_file = span_file
        self._counts_fd: int | None = None
        if span_file is not None:
            self._counts_fd = _open_counts(span_file.with_suffix(COUNTS_SUFFIX))
        synchronous = {
            name: e for name, e in self.exporters.items() if config.synchronous and name == "file"
        }
        for exporter in synchronous.values():
            exporter.after_export = self._write_counts
        batched = [e for name, e in self.exporters.items() if name not in synchronous]
        self.provider: TracerProvider | RecorderProvider
        if config.recorder:
            self.provider = RecorderProvider(
                resource=resource,
                sampler=sampler,
                id_generator=SystemIdGenerator(),
                exporters=batched,
                synchronous=list(synchronous.values()),
                on_start=_stamp_instance,
            )
            self._ended: Callable[[], int] = lambda: self.provider.ended  # type: ignore[union-attr]
        else:
            self.provider = sdk_provider(
                resource, sampler, SystemIdGenerator(), batched, list(synchronous.values())
            )
            ends = EndCounter()
            self.provider.add_span_processor(ends)
            self._ended = lambda: ends.ended
        self._closed = False
        telemetry.use_provider(self.provider)

    def _write_counts(self) -> None:
        """Rewrites the counts file in place (its space was reserved at start)."""
        if self._counts_fd is None:
            return
        record = json.dumps(self.counts(), indent=1).encode()
        try:
            os.pwrite(self._counts_fd, record.ljust(COUNTS_BYTES), 0)
        except OSError as exc:
            logging.getLogger(__name__).warning("cannot write span counts: %s", exc)

    def counts(self) -> dict[str, Any]:
        return {
            "service": self.config.service_name,
            "pid": os.getpid(),
            "ended": self._ended(),
            "exporters": {
                name: {
                    "exported": e.delivered,
                    "failed": e.failed,
                    "dropped": self._ended() - e.delivered,
                    **({"error": e.error[:300]} if e.error else {}),
                }
                for name, e in self.exporters.items()
            },
        }

    def force_flush(self) -> None:
        self.provider.force_flush()

    def shutdown(self) -> dict[str, Any]:
        """Flushes and closes every exporter; writes the counts file; returns the counts."""
        if not self._closed:
            self._closed = True
            self.provider.shutdown()
            telemetry.use_provider(None)
            self._write_counts()
            if self._counts_fd is not None:
                os.close(self._counts_fd)
                self._counts_fd = None
        return self.counts()

    def __enter__(self) -> Tracing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def columnar_available() -> bool:
    """Whether this process can keep the columnar copy of its span file: pyarrow is part of
    the lab, not of the base install (the connector and the server run without it, and then
    leave only the JSON lines, which the loader reads)."""
    import importlib.util

    return importlib.util.find_spec("pyarrow") is not None


def sdk_disabled() -> bool:
    """Whether ``OTEL_SDK_DISABLED`` turns tracing off in this process (OpenTelemetry's
    variable, read as the SDK reads it)."""
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def configure_tracing(
    config: TracingConfig, extra_exporters: Mapping[str, SpanExporter] | None = None
) -> Tracing | None:
    """Installs tracing for this process; ``None`` when ``OTEL_SDK_DISABLED`` is true."""
    if sdk_disabled():
        return None
    exporters: dict[str, SpanExporter] = {}
    span_file = None
    if config.run_dir is not None:
        suffix = "" if config.rank is None else f"-rank{config.rank}"
        span_file = (
            Path(config.run_dir) / SPANS_DIR / f"{config.service_name}{suffix}-{os.getpid()}.jsonl"
        )
        exporters["file"] = JsonLinesSpanExporter(span_file, columnar=columnar_available())
    otlp = (
        otlp_exporter(config.otlp_endpoint, config.otlp_protocol)
        if config.otlp_from_env or config.otlp_endpoint
        else None
    )
    if otlp is not None:
        exporters["otlp"] = otlp
    exporters.update(extra_exporters or {})
    tracing = Tracing(config, exporters, span_file)
    return tracing


def add_otlp_arguments(group: Any) -> None:
    """``--otlp-endpoint`` and ``--otlp-protocol`` (what :func:`otlp_exporter` takes) on an
    argparse parser or group: the server's and ``kvtb``'s flags are these."""
    group.add_argument(
        "--otlp-endpoint", help="also export spans over OTLP (e.g. http://localhost:4317)"
    )
    group.add_argument(
        "--otlp-protocol",
        choices=["grpc", "http/protobuf"],
        help="the OTLP exporter's protocol (default: grpc, or OTEL_EXPORTER_OTLP_PROTOCOL)",
    )


def otlp_exporter(endpoint: str | None = None, protocol: str | None = None) -> SpanExporter | None:
    """The stock OTLP exporter the flag or the ``OTEL_*`` variables ask for, else ``None``."""
    env = os.environ
    wanted = "otlp" in env.get("OTEL_TRACES_EXPORTER", "").lower().split(",")
    env_endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if endpoint is None and not wanted and not env_endpoint:
        return None
    protocol = (
        protocol
        or env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "grpc"
    )
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        if endpoint:
            return HttpExporter(endpoint=endpoint.rstrip("/") + "/v1/traces")
        return HttpExporter()
    raise ValueError(
        f"unsupported OTLP protocol {protocol!r}; use grpc or http/protobuf "
        "(OTEL_EXPORTER_OTLP_PROTOCOL)"
    )


def _open_counts(path: Path) -> int | None:
    """The counts file, created with :data:`COUNTS_BYTES` reserved (``None``: no room)."""
    from testbed.core.owned_files import reserve

    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError:
        return None
    try:
        reserve(fd, COUNTS_BYTES)
        os.pwrite(fd, b"{}".ljust(COUNTS_BYTES), 0)
    except OSError as exc:
        logging.getLogger(__name__).warning("cannot reserve %s: %s", path, exc)
    return fd


def span_counts(run_dir: Path) -> list[dict[str, Any]]:
    """The counts file of each process of a run (those that wrote one)."""
    found = []
    for path in sorted((Path(run_dir) / SPANS_DIR).glob(f"*{COUNTS_SUFFIX}")):
        try:
            counts = json.loads(path.read_text() or "{}")
        except (OSError, ValueError):
            continue
        if counts:
            found.append(counts)
    return found


def read_counts(run_dir: Path) -> dict[str, int]:
    """``spans_exported`` (to files) and ``spans_dropped`` summed over a run's processes."""
    exported = dropped = 0
    for counts in span_counts(run_dir):
        file_counts = counts["exporters"].get("file", {"exported": 0, "dropped": counts["ended"]})
        exported += file_counts["exported"]
        dropped += file_counts["dropped"]
    return {"spans_exported": exported, "spans_dropped": dropped}


def dropped_spans(run_dir: Path) -> list[str]:
    """One line per process of a run whose span file lacks spans: how many, and why."""
    lines = []
    for counts in span_counts(run_dir):
        file_counts = counts["exporters"].get("file")
        if file_counts is None or not file_counts["dropped"]:
            continue
        reason = file_counts.get("error") or "not exported (queue overflow or shutdown)"
        lines.append(
            f"{file_counts['dropped']} spans of {counts['service']} (pid {counts['pid']}) not "
            f"written: {reason}"
        )
    return lines
