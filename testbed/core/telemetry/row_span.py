"""A finished operation's row: :class:`RowSpan`, the API span the recorder hands out, and
:class:`SpanColumns`, the lists its fields are appended to when it ends (any process).

A :class:`RowSpan` keeps what the SDK's span keeps (name, ids, parent, kind, start, attributes,
events, links, status) in plain slots, with the SDK's rules for each method (an overwritten
attribute moves last, a status set to ``OK`` stays, an exception becomes an ``exception``
event), and no lock: a span is used by the thread that started it. ``end`` hands it to its
provider once (:mod:`testbed.core.telemetry.recorder`).

:class:`RowBatch` is how finished rows reach an exporter that writes rows itself (the span file,
:mod:`testbed.core.telemetry.span_file`) without the SDK's span objects being built for them.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind
from opentelemetry.trace.status import Status, StatusCode

COLUMNS = ("name", "context", "parent", "kind", "start", "end", "attributes", "events", "links",
            "status")  # fmt: skip
_UNSET = Status(StatusCode.UNSET)
SCALARS = frozenset((str, bool, int, float))
"""The attribute value types kept as they are (in a sequence, too: one type a sequence)."""


def kept_as_is(
    attributes: Mapping[str, Any], max_count: int | None, max_length: int | None
) -> dict[str, Any] | None:
    """What the SDK's bounded map (``BoundedAttributes(max_count, attributes,
    max_value_len=max_length)``) would hold, as a plain ``dict``, when it would hold the same
    values: none over a limit, each a plain scalar or a list or tuple of one scalar type (as a
    tuple, as the map keeps it). ``None``: the map would change or drop something."""
    if max_length is not None or (max_count is not None and len(attributes) > max_count):
        return None
    lists = False
    for value in attributes.values():
        kind = type(value)
        if kind in SCALARS:
            continue
        if kind is not list and kind is not tuple:
            return None
        kinds = {type(element) for element in value}
        if len(kinds) > 1 or not kinds <= SCALARS:
            return None
        lists = True
    if lists:
        return {k: tuple(v) if type(v) is list else v for k, v in attributes.items()}
    return attributes if type(attributes) is dict else dict(attributes)


class Recording(Protocol):
    """What a span needs of its provider: the SDK's limits, and where it goes when it ends."""

    limits: SpanLimits

    def record(self, span: RowSpan, end_ns: int) -> None: ...


class SpanColumns:
    """Finished spans, one list per field (:data:`COLUMNS`); :meth:`rows` reads them back."""

    __slots__ = ("count", *COLUMNS)

    def __init__(self) -> None:
        self.count = 0
        self.name: list[str] = []
        self.context: list[SpanContext] = []
        self.parent: list[SpanContext | None] = []
        self.kind: list[SpanKind] = []
        self.start: list[int] = []
        self.end: list[int] = []
        self.attributes: list[dict[str, Any]] = []
        self.events: list[list[Event] | None] = []
        self.links: list[tuple[Link, ...]] = []
        self.status: list[Status] = []

    def rows(self) -> Iterator[tuple[Any, ...]]:
        return zip(*(getattr(self, name) for name in COLUMNS), strict=True)


Row = tuple[Any, ...]
"""One finished span's fields in :data:`COLUMNS` order (its attributes as the SDK's bounded map
would keep them: a plain ``dict`` when that map would keep them unchanged)."""


class SpanFields(NamedTuple):
    """What the span file and its columnar copy write of a span, its ids as hex text."""

    trace_id: str
    span_id: str
    parent_id: str
    """``""`` for a root."""
    name: str
    kind: SpanKind
    start: int | None
    end: int | None
    attributes: Mapping[str, Any] | None
    events: Sequence[Event] | None
    links: Sequence[Link] | None
    status: Status

    @classmethod
    def of_span(cls, span: ReadableSpan) -> SpanFields:
        context = span.get_span_context()
        assert context is not None
        return cls(
            f"{context.trace_id:032x}",
            f"{context.span_id:016x}",
            f"{span.parent.span_id:016x}" if span.parent else "",
            span.name,
            span.kind,
            span.start_time,
            span.end_time,
            span.attributes,
            span.events,
            span.links,
            span.status,
        )

    @classmethod
    def of_row(cls, row: Row) -> SpanFields:
        name, context, parent, kind, start, end, attributes, events, links, status = row
        return cls(
            f"{context.trace_id:032x}",
            f"{context.span_id:016x}",
            f"{parent.span_id:016x}" if parent else "",
            name,
            kind,
            start,
            end,
            attributes,
            events,
            links,
            status,
        )


@dataclass(frozen=True, eq=False)
class RowBatch:
    """Finished spans of one resource and scope, as rows, for an exporter that writes rows
    itself (``export_rows``); ``readable`` builds the SDK's span of a row, for the rows such an
    exporter leaves to the SDK's encoding."""

    resource: Resource
    scope: InstrumentationScope
    rows: Sequence[Row]
    readable: Callable[[Row], ReadableSpan]

    def __len__(self) -> int:
        return len(self.rows)


class RowSpan(trace.Span):
    """A recording span whose ``end`` appends it to its provider's columns (API methods only)."""

    __slots__ = ("_provider", "_name", "_context", "_parent", "_kind", "_start", "_attributes",
                 "_events", "_links", "_status", "_ended")  # fmt: skip

    def __init__(
        self,
        provider: Recording,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        kind: SpanKind,
        attributes: dict[str, Any],
        links: tuple[Link, ...],
        start_ns: int,
    ) -> None:
        self._provider = provider
        self._name = name
        self._context = context
        self._parent = parent
        self._kind = kind
        self._start = start_ns
        self._attributes = attributes
        self._events: list[Event] | None = None
        self._links = links
        self._status = _UNSET
        self._ended = False

    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return not self._ended

    def set_attribute(self, key: str, value: Any) -> None:
        if not self._ended:
            attributes = self._attributes
            attributes.pop(key, None)  # the SDK's bounded map moves an overwritten key last
            attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        if not self._ended:
            mine = self._attributes
            for key, value in attributes.items():
                mine.pop(key, None)
                mine[key] = value

    def add_event(
        self, name: str, attributes: Mapping[str, Any] | None = None, timestamp: int | None = None
    ) -> None:
        if self._ended:
            return
        limits = self._provider.limits
        kept = kept_as_is(
            attributes or {}, limits.max_event_attributes, limits.max_attribute_length
        )
        if kept is not None:
            kept = dict(kept) if kept is attributes else kept  # the caller's dict may change
        event = Event(
            name,
            kept
            if kept is not None
            else BoundedAttributes(
                limits.max_event_attributes,
                attributes,
                immutable=True,
                max_value_len=limits.max_attribute_length,
            ),
            timestamp,
        )
        if self._events is None:
            self._events = []
        self._events.append(event)

    def update_name(self, name: str) -> None:
        if not self._ended:
            self._name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        if self._ended or self._status.status_code is StatusCode.OK:
            return
        if isinstance(status, Status):
            if status.status_code is not StatusCode.UNSET:
                self._status = status
        elif status is not StatusCode.UNSET:
            self._status = Status(status, description)

    def record_exception(
        self,
        exception: BaseException,
        attributes: Mapping[str, Any] | None = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        """As the SDK's span records one: an ``exception`` event with type, message, stack."""
        module = type(exception).__module__
        qualname = type(exception).__qualname__
        recorded: dict[str, Any] = {
            "exception.type": f"{module}.{qualname}"
            if module and module != "builtins"
            else qualname,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
        }
        recorded.update(attributes or {})
        self.add_event("exception", recorded, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self._ended:
            return
        self._ended = True
        self._provider.record(self, time.time_ns() if end_time is None else end_time)

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is not None and not self._ended:
            self.record_exception(exc, escaped=True)
            self.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        super().__exit__(exc_type, exc, tb)
