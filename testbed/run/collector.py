"""A minimal OTLP/HTTP trace collector that writes what it receives into a run directory.

Processes that export with the stock OTLP exporters (vLLM started with
``--otlp-traces-endpoint``, any OpenTelemetry SDK) can send their spans here; they land in
``<run_dir>/spans/collected-<pid>.jsonl`` in the same OTLP JSON-lines format as the testbed's
own span files (trace and span ids as hex), so ``testbed.analysis`` reads them with the rest.
``kvtb run --engine serve --launch`` runs one for the vLLM server it starts: vLLM forwards a
request's W3C trace context to the engine only when its own tracing is on, and the connector's
spans then hang under the request that caused them.

Serves ``POST /v1/traces`` (``application/x-protobuf``, optionally gzip or deflate) on 127.0.0.1
(:class:`OtlpTracesHandler`).
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import threading
import zlib
from collections.abc import Callable
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from testbed.core.run_dir import RunDir
from testbed.core.telemetry.setup import COLLECTED_PREFIX, COUNTS_SUFFIX

TRACES_PATH = "/v1/traces"
_PROTOBUF = "application/x-protobuf"
_ID_FIELDS = ("traceId", "spanId", "parentSpanId")
_DECOMPRESS: dict[str, Callable[[bytes], bytes]] = {
    "": bytes,
    "gzip": gzip.decompress,
    "deflate": zlib.decompress,
}


def to_otlp_json(request: Any) -> dict[str, Any]:
    """An ``ExportTraceServiceRequest`` as one OTLP JSON ``TracesData`` object (hex ids)."""
    from google.protobuf.json_format import MessageToDict

    document = MessageToDict(request, use_integers_for_enums=True)
    for resource_spans in document.get("resourceSpans", []):
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                _hex_ids(span)
                for link in span.get("links", []):
                    _hex_ids(link)
                # Protobuf's JSON leaves out defaults; the testbed's files always hold them.
                span.setdefault("parentSpanId", "")
                span.setdefault("kind", 0)
                span.setdefault("attributes", [])
                span.setdefault("status", {})
                span["status"].setdefault("code", 0)
                span.setdefault("startTimeUnixNano", "0")
                span.setdefault("endTimeUnixNano", "0")
        resource_spans.setdefault("resource", {}).setdefault("attributes", [])
    return {"resourceSpans": document.get("resourceSpans", [])}


def _hex_ids(item: dict[str, Any]) -> None:
    for field in _ID_FIELDS:
        if item.get(field):
            item[field] = base64.b64decode(item[field]).hex()


class SpanCollector:
    """The collector on a free loopback port. Context manager."""

    def __init__(self, run_dir: Path) -> None:
        directory = RunDir(Path(run_dir)).spans
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{COLLECTED_PREFIX}{os.getpid()}.jsonl"
        self.received = 0
        self._lock = threading.Lock()
        self._file = self.path.open("a", encoding="utf-8")
        self._server = ThreadingHTTPServer(
            ("127.0.0.1", 0), partial(OtlpTracesHandler, record=self.record)
        )
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,))
        self._thread.daemon = True

    @property
    def endpoint(self) -> str:
        """The URL OTLP/HTTP exporters post to (``.../v1/traces``)."""
        return f"http://127.0.0.1:{self._server.server_address[1]}{TRACES_PATH}"

    def start(self) -> SpanCollector:
        self._thread.start()
        return self

    def record(self, request: Any) -> None:
        document = to_otlp_json(request)
        spans = sum(
            len(scope.get("spans", []))
            for resource in document["resourceSpans"]
            for scope in resource.get("scopeSpans", [])
        )
        with self._lock:
            self._file.write(json.dumps(document, separators=(",", ":")) + "\n")
            self._file.flush()
            self.received += spans

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            self._file.close()
            counts = {
                "service": "collected",
                "pid": os.getpid(),
                "ended": self.received,
                "exporters": {"file": {"exported": self.received, "failed": 0, "dropped": 0}},
            }
            self.path.with_suffix(COUNTS_SUFFIX).write_text(json.dumps(counts, indent=1))

    def __enter__(self) -> SpanCollector:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class OtlpTracesHandler(BaseHTTPRequestHandler):
    """OTLP/HTTP's ``POST /v1/traces``: each decoded ``ExportTraceServiceRequest`` goes to
    ``record``, answered 200 with an ``ExportTraceServiceResponse``; 400 for an undecodable
    body, 404 for another path, 415 for another media type or encoding (none, gzip, deflate).
    Bind ``record`` with ``functools.partial`` to make the handler class a server takes."""

    def __init__(self, *args: Any, record: Callable[[Any], None], **kwargs: Any) -> None:
        self._record = record
        super().__init__(*args, **kwargs)

    def do_POST(self) -> None:
        from google.protobuf.message import DecodeError
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb

        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        encoding = self.headers.get("Content-Encoding", "").strip().lower()
        if self.path.partition("?")[0] != TRACES_PATH:
            return self._reply(404)
        if self.headers.get_content_type() != _PROTOBUF or encoding not in _DECOMPRESS:
            return self._reply(415)
        try:
            request = pb.ExportTraceServiceRequest.FromString(_DECOMPRESS[encoding](body))
        except (DecodeError, OSError, EOFError, zlib.error):
            return self._reply(400)
        self._record(request)
        self._reply(200, pb.ExportTraceServiceResponse().SerializeToString())

    def _reply(self, status: int, body: bytes = b"") -> None:
        self.send_response(status)
        self.send_header("Content-Type", _PROTOBUF)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: requests are not worth a log line each."""
