"""Prove that the stock OTLP span exporters deliver to OtlpReceiver, in and out of process."""

from __future__ import annotations

import gzip
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from urllib.parse import urlparse

import pytest
from opentelemetry.exporter.otlp.proto.grpc import trace_exporter as grpc_exporter
from opentelemetry.exporter.otlp.proto.http import trace_exporter as http_exporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.proto.resource.v1.resource_pb2 import Resource as ProtoResource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanContext, SpanKind, StatusCode
from opentelemetry.util.types import AttributeValue

from testbed.run.collector import TRACES_PATH
from tests.support.otlp_receiver import OtlpReceiver, Protocol, ReceivedSpan

PROTOCOLS: list[Protocol] = ["grpc", "http"]
PROTOBUF = "application/x-protobuf"
NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
ROOT_ATTRIBUTES: dict[str, AttributeValue] = {
    "s": "text",
    "b": True,
    "i": 2**40,
    "f": 0.25,
    "strs": ["a"],
    "ints": [1, 2],
}

CHILD_EXPLICIT_EXPORTER = """
import os
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
if os.environ["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc":
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
else:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
provider = TracerProvider()
provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
"""

CHILD_SDK_AUTOCONFIGURE = """
import os
from opentelemetry import trace
from opentelemetry.sdk._configuration import _OTelSDKConfigurator
_OTelSDKConfigurator().configure()
provider = trace.get_tracer_provider()
"""

CHILD_WORK = """
tracer = provider.get_tracer("child")
with tracer.start_as_current_span("child-root"):
    with tracer.start_as_current_span("child-leaf") as leaf:
        leaf.set_attribute("child.pid", os.getpid())
provider.shutdown()
print(os.getpid())
"""


@pytest.fixture(params=PROTOCOLS)
def receiver(request: pytest.FixtureRequest) -> Iterator[OtlpReceiver]:
    with OtlpReceiver(request.param) as started:
        yield started


def stock_exporter(receiver: OtlpReceiver) -> SpanExporter:
    """The stock exporter for the receiver's protocol, aimed at it by explicit arguments."""
    if receiver.protocol == "grpc":
        return grpc_exporter.OTLPSpanExporter(endpoint=receiver.endpoint, insecure=True, timeout=5)
    return http_exporter.OTLPSpanExporter(endpoint=receiver.endpoint + TRACES_PATH, timeout=5)


def hex_ids(context: SpanContext) -> tuple[str, str]:
    return format(context.trace_id, "032x"), format(context.span_id, "016x")


def post(
    url: str, body: bytes, content_type: str = PROTOBUF, encoding: str = ""
) -> tuple[int, bytes]:
    """POST bypassing any proxy; returns (status, body) for error statuses too."""
    headers = {"Content-Type": content_type} | ({"Content-Encoding": encoding} if encoding else {})
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with NO_PROXY_OPENER.open(request, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_sdk_batch_exporter_delivers_nested_spans(receiver: OtlpReceiver) -> None:
    sent = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "receiver-test"}))
    provider.add_span_processor(SimpleSpanProcessor(sent))
    provider.add_span_processor(BatchSpanProcessor(stock_exporter(receiver)))
    tracer = provider.get_tracer("test")
    try:
        with tracer.start_as_current_span("linked") as linked:
            pass
        link = Link(linked.get_span_context())
        with tracer.start_as_current_span("root", kind=SpanKind.SERVER) as root:
            root.set_attributes(ROOT_ATTRIBUTES)
            with (
                tracer.start_as_current_span("child", kind=SpanKind.CLIENT, links=[link]),
                tracer.start_as_current_span("leaf") as leaf,
            ):
                leaf.set_status(StatusCode.ERROR)
        assert provider.force_flush(timeout_millis=10_000)
    finally:
        provider.shutdown()

    received = {span.name: span for span in receiver.wait_for(4, timeout_s=5)}
    assert len(receiver.spans()) == 4 and set(received) == {"linked", "root", "child", "leaf"}
    finished = sent.get_finished_spans()
    assert len(finished) == 4
    for span in finished:
        got = received[span.name]
        assert span.context and (got.trace_id, got.span_id) == hex_ids(span.context)
        assert (got.start_time_unix_nano, got.end_time_unix_nano) == (
            span.start_time,
            span.end_time,
        )
        assert got.resource["service.name"] == "receiver-test"
    assert received["linked"].trace_id != received["root"].trace_id
    assert received["root"].parent_span_id is None
    assert received["child"].parent_span_id == received["root"].span_id
    assert received["leaf"].parent_span_id == received["child"].span_id
    assert received["root"].attributes == ROOT_ATTRIBUTES
    assert [received[name].kind for name in ("root", "child", "leaf")] == [
        Span.SPAN_KIND_SERVER,
        Span.SPAN_KIND_CLIENT,
        Span.SPAN_KIND_INTERNAL,
    ]
    assert received["child"].links == [hex_ids(linked.get_span_context())]
    assert received["leaf"].status_code == Status.STATUS_CODE_ERROR


@pytest.mark.parametrize(
    "child_setup", [CHILD_EXPLICIT_EXPORTER, CHILD_SDK_AUTOCONFIGURE], ids=["exporter", "autoconf"]
)
def test_child_configured_only_by_env_delivers_spans(
    receiver: OtlpReceiver, child_setup: str
) -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
    env.update(receiver.env(), OTEL_SERVICE_NAME="env-child")
    env.update(OTEL_METRICS_EXPORTER="none", OTEL_LOGS_EXPORTER="none")
    command = [sys.executable, "-c", child_setup + CHILD_WORK]
    child = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr

    spans = receiver.wait_for(2, timeout_s=10)
    by_name = {span.name: span for span in spans}
    assert len(spans) == 2 and set(by_name) == {"child-root", "child-leaf"}
    assert by_name["child-leaf"].parent_span_id == by_name["child-root"].span_id
    assert by_name["child-leaf"].attributes == {"child.pid": int(child.stdout)}
    assert all(span.resource["service.name"] == "env-child" for span in spans)


def handmade_request() -> tuple[ExportTraceServiceRequest, ReceivedSpan]:
    """A request using every AnyValue kind, and the span the receiver must decode from it."""
    array = ArrayValue(values=[AnyValue(int_value=1), AnyValue(string_value="two")])
    kvlist = KeyValueList(values=[KeyValue(key="k", value=AnyValue(bool_value=True))])
    values = {
        "s": AnyValue(string_value="x"),
        "b": AnyValue(bool_value=False),
        "i": AnyValue(int_value=-7),
        "d": AnyValue(double_value=1.5),
        "raw": AnyValue(bytes_value=b"\x00\xff"),
        "arr": AnyValue(array_value=array),
        "kv": AnyValue(kvlist_value=kvlist),
    }
    span = Span(
        trace_id=bytes(range(16)),
        span_id=bytes(range(8)),
        parent_span_id=b"\xab" * 8,
        name="handmade",
        kind=Span.SPAN_KIND_PRODUCER,
        start_time_unix_nano=10,
        end_time_unix_nano=20,
        attributes=[KeyValue(key=key, value=value) for key, value in values.items()],
        links=[Span.Link(trace_id=b"\x11" * 16, span_id=b"\x22" * 8)],
        status=Status(code=Status.STATUS_CODE_OK),
    )
    name = KeyValue(key="service.name", value=AnyValue(string_value="handmade"))
    resource_spans = ResourceSpans(
        resource=ProtoResource(attributes=[name]), scope_spans=[ScopeSpans(spans=[span])]
    )
    expected = ReceivedSpan(
        trace_id="000102030405060708090a0b0c0d0e0f",
        span_id="0001020304050607",
        parent_span_id="ab" * 8,
        name="handmade",
        kind=Span.SPAN_KIND_PRODUCER,
        start_time_unix_nano=10,
        end_time_unix_nano=20,
        attributes={
            **{"s": "x", "b": False, "i": -7, "d": 1.5, "raw": b"\x00\xff"},
            **{"arr": [1, "two"], "kv": {"k": True}},
        },
        resource={"service.name": "handmade"},
        status_code=Status.STATUS_CODE_OK,
        links=[("11" * 16, "22" * 8)],
    )
    return ExportTraceServiceRequest(resource_spans=[resource_spans]), expected


def test_http_rejects_bad_requests_then_accepts_gzip() -> None:
    with OtlpReceiver("http") as receiver:
        url = receiver.endpoint + TRACES_PATH
        assert post(url, b"not a protobuf")[0] == 400
        assert post(url, b"not gzip", encoding="gzip")[0] == 400
        assert post(url, b"{}", content_type="application/json")[0] == 415
        assert post(url, b"", encoding="br")[0] == 415
        assert post(receiver.endpoint + "/v1/metrics", b"")[0] == 404
        assert receiver.spans() == []

        request, expected = handmade_request()
        status, body = post(url, gzip.compress(request.SerializeToString()), encoding="gzip")
        assert status == 200
        assert ExportTraceServiceResponse.FromString(body) == ExportTraceServiceResponse()
        assert receiver.wait_for(1, timeout_s=1) == [expected]


def test_wait_for_reports_how_many_arrived() -> None:
    with OtlpReceiver("http") as receiver, pytest.raises(TimeoutError, match="0 arrived"):
        receiver.wait_for(1, timeout_s=0.1)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_close_is_idempotent_and_releases_the_port(protocol: Protocol) -> None:
    receiver = OtlpReceiver(protocol)
    with pytest.raises(RuntimeError, match="not started"):
        receiver.env()
    with receiver:
        port = urlparse(receiver.endpoint).port
        assert port and receiver.endpoint == f"http://127.0.0.1:{port}"
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    receiver.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1)
    with pytest.raises(RuntimeError):
        receiver.start()


@pytest.mark.parametrize(
    ("protocol", "selection"),
    [
        ("grpc", {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_INSECURE": "true"}),
        ("http", {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}),
    ],
)
def test_env_names_exactly_the_standard_variables(
    protocol: Protocol, selection: dict[str, str]
) -> None:
    with OtlpReceiver(protocol) as receiver:
        assert receiver.env() == {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            **selection,
        }
