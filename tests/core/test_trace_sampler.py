"""The run's ratio sampler keeps a recorded request's story whole: a span follows its parent,
and a span that links to a recorded span (a batched store or retrieve serving that request)
is recorded even when its parent, the batch's first request, was not."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Link

from testbed.core.telemetry.sampling import make_sampler


def test_a_batch_linked_to_a_recorded_request_is_recorded_with_it():
    tracer = TracerProvider(sampler=make_sampler("traceidratio", 0.5)).get_tracer("test")
    requests = [tracer.start_span(f"request {n}") for n in range(64)]
    kept = [span for span in requests if span.is_recording()]
    dropped = [span for span in requests if not span.is_recording()]
    assert kept and dropped  # half of 64, give or take
    context = trace.set_span_in_context(dropped[0])  # the batch's first request: unrecorded
    alone = tracer.start_span("batch of unrecorded requests", context=context,
                              links=[Link(dropped[1].get_span_context())])  # fmt: skip
    serving = tracer.start_span("batch serving a recorded request", context=context,
                                links=[Link(kept[0].get_span_context())])  # fmt: skip
    child = tracer.start_span("server side", context=trace.set_span_in_context(kept[0]))
    assert not alone.is_recording()
    assert serving.is_recording() and serving.get_span_context().trace_flags.sampled
    assert child.is_recording()  # a recorded request's server spans follow it
    server = tracer.start_span("server side", context=trace.set_span_in_context(serving))
    assert server.is_recording()  # and so do the batch's
