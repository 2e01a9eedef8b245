"""In-process OTLP trace receiver on 127.0.0.1 for end-to-end span tests.

Contract:
- ``OtlpReceiver(protocol)`` binds an OS-chosen free port when entered or ``start()``-ed
  and stops on exit or ``close()`` (idempotent); it cannot be restarted.
- ``"grpc"`` serves the OTLP ``TraceService/Export`` RPC in plaintext. ``"http"`` serves
  ``POST /v1/traces`` with the handler of ``kvtb``'s own collector
  (``testbed.run.collector.OtlpTracesHandler``: protobuf, optionally gzip or deflate).
- The stock OTLP proto exporters reach it unchanged through ``endpoint`` or the ``OTEL_*``
  variables of ``env()``. Signal-specific ``OTEL_EXPORTER_OTLP_TRACES_*`` variables win
  over those, so drop inherited ``OTEL_*`` variables before applying ``env()``.
- Every span of every accepted request is kept in arrival order and can be read from any
  thread with ``spans()`` and ``wait_for()``, also after ``close()``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass
from functools import partial
from http.server import ThreadingHTTPServer
from typing import Literal

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as pb_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from testbed.run.collector import OtlpTracesHandler

Protocol = Literal["grpc", "http"]
_Record = Callable[[pb.ExportTraceServiceRequest], None]


@dataclass(frozen=True)
class ReceivedSpan:
    """One received span: ids as lowercase hex, attribute values as plain Python."""

    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    kind: int
    start_time_unix_nano: int
    end_time_unix_nano: int
    attributes: dict[str, object]
    resource: dict[str, object]
    status_code: int
    links: list[tuple[str, str]]


def _value(value: AnyValue) -> object:
    field = value.WhichOneof("value")
    if field == "array_value":
        return [_value(item) for item in value.array_value.values]
    if field == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    return None if field is None else getattr(value, field)


def _attributes(pairs: Iterable[KeyValue]) -> dict[str, object]:
    return {pair.key: _value(pair.value) for pair in pairs}


def _decode(request: pb.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    return [
        ReceivedSpan(
            trace_id=span.trace_id.hex(),
            span_id=span.span_id.hex(),
            parent_span_id=span.parent_span_id.hex() or None,
            name=span.name,
            kind=span.kind,
            start_time_unix_nano=span.start_time_unix_nano,
            end_time_unix_nano=span.end_time_unix_nano,
            attributes=_attributes(span.attributes),
            resource=_attributes(resource_spans.resource.attributes),
            status_code=span.status.code,
            links=[(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
        )
        for resource_spans in request.resource_spans
        for scope_spans in resource_spans.scope_spans
        for span in scope_spans.spans
    ]


class _TraceService(pb_grpc.TraceServiceServicer):
    def __init__(self, record: _Record) -> None:
        self._record = record

    def Export(
        self, request: pb.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> pb.ExportTraceServiceResponse:
        self._record(request)
        return pb.ExportTraceServiceResponse()


def _serve_grpc(record: _Record) -> tuple[int, Callable[[], None]]:
    executor = futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="otlp-grpc")
    options = [("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", 64 << 20)]
    server = grpc.server(executor, options=options)
    pb_grpc.add_TraceServiceServicer_to_server(_TraceService(record), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    def stop() -> None:
        server.stop(grace=None).wait()
        executor.shutdown()

    return port, stop


def _serve_http(record: _Record) -> tuple[int, Callable[[], None]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(OtlpTracesHandler, record=record))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join()

    return server.server_address[1], stop


class OtlpReceiver:
    """OTLP trace receiver on 127.0.0.1; the module docstring states the contract."""

    def __init__(self, protocol: Protocol) -> None:
        if protocol not in ("grpc", "http"):
            raise ValueError(f"protocol must be 'grpc' or 'http', not {protocol!r}")
        self.protocol: Protocol = protocol
        self._arrived = threading.Condition()
        self._spans: list[ReceivedSpan] = []
        self._port: int | None = None
        self._stop: Callable[[], None] | None = None

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self) -> OtlpReceiver:
        """Bind a free port and serve; RuntimeError if this receiver was started before."""
        if self._port is not None:
            raise RuntimeError("an OtlpReceiver can be started only once")
        serve = _serve_grpc if self.protocol == "grpc" else _serve_http
        self._port, self._stop = serve(self._record)
        return self

    def close(self) -> None:
        """Stop serving and free the port; later calls do nothing."""
        stop, self._stop = self._stop, None
        if stop is not None:
            stop()

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT``; OTLP/HTTP traces go to this plus ``TRACES_PATH``."""
        if self._port is None:
            raise RuntimeError("receiver not started")
        return f"http://127.0.0.1:{self._port}"

    def env(self) -> dict[str, str]:
        """The ``OTEL_*`` variables that point a stock OTLP span exporter here."""
        grpc_selected = self.protocol == "grpc"
        return {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc" if grpc_selected else "http/protobuf",
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
            **({"OTEL_EXPORTER_OTLP_INSECURE": "true"} if grpc_selected else {}),
        }

    def spans(self) -> list[ReceivedSpan]:
        """A snapshot of every span received so far, in arrival order."""
        with self._arrived:
            return list(self._spans)

    def wait_for(self, count: int, timeout_s: float) -> list[ReceivedSpan]:
        """All spans once at least ``count`` arrived; TimeoutError naming how many did."""
        with self._arrived:
            if not self._arrived.wait_for(lambda: len(self._spans) >= count, timeout_s):
                arrived = len(self._spans)
                raise TimeoutError(f"waited {timeout_s}s for {count} spans, {arrived} arrived")
            return list(self._spans)

    def _record(self, request: pb.ExportTraceServiceRequest) -> None:
        spans = _decode(request)
        with self._arrived:
            self._spans.extend(spans)
            self._arrived.notify_all()
