"""Which traces a run records: OpenTelemetry's trace sampler, as a value a run spec holds.

The standard variables ``OTEL_TRACES_SAMPLER`` and ``OTEL_TRACES_SAMPLER_ARG`` choose a
sampler for any OpenTelemetry SDK. A run must not pick one up silently: a sampled run records
only some requests, and its figures are then estimates. So the variables are read once, when a
spec is parsed (:func:`from_environment`), the sampler and its ratio become fields of the run
spec (part of its id: a sampled run is never reused for an unsampled one), and every process of
the run is given exactly that sampler (:func:`make_sampler` in the engine, :func:`environment`
for the processes it starts), whatever their own environment says.

The ratio samplers keep a recorded request's story whole: a span follows its parent's decision
(as ``parentbased_traceidratio`` does; kvtestbed reads ``traceidratio`` the same way, so that
a server span is kept with the connector span that caused it), and a span that *links* to a
kept span is kept too (:class:`KeepLinked`): a batched store or retrieve, parented on the
first request it serves, is recorded when any request it serves is. OpenTelemetry's own
samplers decide per trace and would drop the retrieve of a recorded request whose batch began
with an unrecorded one, and its loaded tokens would look failed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

from opentelemetry.context import Context
from opentelemetry.sdk.trace import sampling
from opentelemetry.trace import Link, SpanKind
from opentelemetry.trace.span import TraceState
from opentelemetry.util.types import Attributes

SAMPLER_ENV = "OTEL_TRACES_SAMPLER"
SAMPLER_ARG_ENV = "OTEL_TRACES_SAMPLER_ARG"
RATIO_SAMPLERS = ("traceidratio", "parentbased_traceidratio")
"""Samplers that keep a share of the traces (the ratio, 0 to 1)."""
SAMPLERS = (
    "parentbased_always_on",
    "always_on",
    "always_off",
    "parentbased_always_off",
    *RATIO_SAMPLERS,
)
"""The SDK's built-in samplers, by the names ``OTEL_TRACES_SAMPLER`` takes."""
DEFAULT_SAMPLER = "parentbased_always_on"
"""The SDK's default: every trace a process starts is recorded."""


def check(name: str, ratio: float | None) -> list[str]:
    """Problems with a sampler setting, one sentence each (empty when it is valid)."""
    if name not in SAMPLERS:
        return [f"trace_sampler must be one of {', '.join(SAMPLERS)}, got {name!r}"]
    if name in RATIO_SAMPLERS:
        if ratio is None or not 0.0 <= ratio <= 1.0:
            return [f"trace_sampler {name} needs trace_sampler_ratio between 0 and 1, got {ratio}"]
    elif ratio is not None:
        return [f"trace_sampler_ratio applies to {' and '.join(RATIO_SAMPLERS)} only"]
    return []


def records_every_trace(name: str, ratio: float | None) -> bool:
    """Whether the sampler keeps every trace a run starts."""
    if name in RATIO_SAMPLERS:
        return ratio is not None and ratio >= 1.0
    return name in ("always_on", "parentbased_always_on")


def describe(name: str, ratio: float | None) -> str:
    """``every trace`` or the sampler and its ratio, for summaries and reports."""
    if records_every_trace(name, ratio):
        return "every trace recorded"
    return f"sampled: {name}" + ("" if ratio is None else f", ratio {ratio:g}")


def from_environment(env: Mapping[str, str] | None = None) -> dict[str, object]:
    """The run keys ``trace_sampler`` and ``trace_sampler_ratio`` the variables ask for
    (a ratio sampler without ``OTEL_TRACES_SAMPLER_ARG`` keeps every trace, as the SDK's
    does); ``{}`` when ``OTEL_TRACES_SAMPLER`` is not set."""
    env = os.environ if env is None else env
    name = env.get(SAMPLER_ENV, "").strip().lower()
    if not name:
        return {}
    if name not in RATIO_SAMPLERS:
        return {"trace_sampler": name}
    raw = env.get(SAMPLER_ARG_ENV, "").strip()
    try:
        ratio = float(raw) if raw else 1.0
    except ValueError:
        raise ValueError(f"{SAMPLER_ARG_ENV}={raw!r} is not a ratio between 0 and 1") from None
    return {"trace_sampler": name, "trace_sampler_ratio": ratio}


def environment(name: str, ratio: float | None) -> dict[str, str]:
    """The variables that give a child process exactly this sampler."""
    return {SAMPLER_ENV: name, SAMPLER_ARG_ENV: "" if ratio is None else repr(float(ratio))}


class KeepLinked(sampling.Sampler):
    """Parent-based sampling around a root sampler, that also keeps a span linking to a kept
    span (a link's ``sampled`` flag)."""

    def __init__(self, root: sampling.Sampler) -> None:
        self._parent_based = sampling.ParentBased(root)
        self._root = root

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> sampling.SamplingResult:
        result = self._parent_based.should_sample(
            parent_context, trace_id, name, kind, attributes, links, trace_state
        )
        if result.decision is sampling.Decision.DROP and any(
            link.context.trace_flags.sampled for link in links or ()
        ):
            return sampling.SamplingResult(
                sampling.Decision.RECORD_AND_SAMPLE, attributes, result.trace_state
            )
        return result

    def get_description(self) -> str:
        return f"KeepLinked{{{self._root.get_description()}}}"


def make_sampler(name: str, ratio: float | None) -> sampling.Sampler:
    """The sampler of that name (and ratio); the ratio samplers as :class:`KeepLinked`."""
    problems = check(name, ratio)
    if problems:
        raise ValueError(problems[0])
    return _FACTORIES[name](float(ratio or 0.0))


def sampler_from_environment(env: Mapping[str, str] | None = None) -> sampling.Sampler | None:
    """The sampler the variables ask for (:func:`make_sampler`); ``None`` when they ask for
    none (the SDK's default then applies)."""
    keys = from_environment(env)
    if not keys:
        return None
    return make_sampler(str(keys["trace_sampler"]), keys.get("trace_sampler_ratio"))  # type: ignore[arg-type]


_FACTORIES: dict[str, Callable[[float], sampling.Sampler]] = {
    "always_on": lambda _: sampling.ALWAYS_ON,
    "always_off": lambda _: sampling.ALWAYS_OFF,
    "parentbased_always_on": lambda _: sampling.ParentBased(sampling.ALWAYS_ON),
    "parentbased_always_off": lambda _: sampling.ParentBased(sampling.ALWAYS_OFF),
    "traceidratio": lambda ratio: KeepLinked(sampling.TraceIdRatioBased(ratio)),
    "parentbased_traceidratio": lambda ratio: KeepLinked(sampling.TraceIdRatioBased(ratio)),
}
