"""Workloads: seeded generators and trace readers, made from a spec string.

``make_workload("chat", num_requests=100)``, ``make_workload("mooncake:PATH", ...)`` or
``make_workload("agentic:PATH", params={"users": 4})``; see :class:`Workload` for what every
workload promises and each generator's or reader's class docstring (and its params
dataclass) for its parameters and defaults. Block-hash traces (Mooncake, agentic) share their
mechanics in :mod:`.block_trace` and :mod:`.block_keys`; :mod:`.arrivals` says when requests
arrive at an engine (open loop, or closed-loop users).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from testbed.workloads.agentic import AgenticParams, AgenticWorkload
from testbed.workloads.arrivals import ArrivalProcess, ClosedLoop, OpenLoop
from testbed.workloads.base import (
    RequestShape,
    Workload,
    WorkloadOptions,
    WorkloadRequest,
)
from testbed.workloads.block_trace import BlockRequest, BlockTraceWorkload
from testbed.workloads.chat import ChatParams, ChatWorkload
from testbed.workloads.documents import DocQAParams, DocQAWorkload, RAGParams, RAGWorkload
from testbed.workloads.generator import Generator
from testbed.workloads.mooncake import BLOCK_TOKENS, MooncakeWorkload
from testbed.workloads.no_reuse import RandomParams, RandomWorkload
from testbed.workloads.params import parse_params

__all__ = [
    "BLOCK_TOKENS",
    "AgenticParams",
    "AgenticWorkload",
    "ArrivalProcess",
    "BlockRequest",
    "BlockTraceWorkload",
    "ClosedLoop",
    "TRACE_PREFIXES",
    "WORKLOADS",
    "ChatParams",
    "ChatWorkload",
    "DocQAParams",
    "DocQAWorkload",
    "MooncakeWorkload",
    "OpenLoop",
    "RAGParams",
    "RAGWorkload",
    "RandomParams",
    "RandomWorkload",
    "RequestShape",
    "Workload",
    "WorkloadOptions",
    "WorkloadRequest",
    "arrival_process",
    "closed_loop",
    "make_workload",
    "workload_choices",
]

WORKLOADS: dict[str, type[Generator]] = {
    cls.name: cls for cls in (ChatWorkload, DocQAWorkload, RAGWorkload, RandomWorkload)
}
"""Generator name -> class (its docstring documents it, ``params_type`` its parameters)."""

TRACE_PREFIXES: dict[str, type[MooncakeWorkload] | type[AgenticWorkload]] = {
    "mooncake": MooncakeWorkload,
    "agentic": AgenticWorkload,
}
"""Trace reader prefix (spec ``PREFIX:PATH``) -> class (``open(path, options, params)``)."""


def workload_choices() -> str:
    """The valid specs, for help texts and error messages."""
    return ", ".join([*WORKLOADS, *(f"{prefix}:PATH" for prefix in TRACE_PREFIXES)])


def make_workload(
    spec: str,
    *,
    num_requests: int | None,
    seed: int = 0,
    vocab_size: int = 32000,
    max_output_tokens: int | None = None,
    params: Mapping[str, object] | None = None,
) -> Workload:
    """The workload named by ``spec``: a generator name or ``PREFIX:PATH`` of a trace.

    ``num_requests=None`` means the whole trace, or the generator's default (64 unless its
    params fix the count). ``max_output_tokens`` caps every request's output. ``params`` are
    the generator's or reader's parameters (Mooncake takes none). Unknown specs or param keys
    and bad values raise ValueError naming the bad thing and the valid choices. Constructing
    reads no tokens; iterating does.
    """
    options = WorkloadOptions(
        num_requests=num_requests,
        seed=seed,
        vocab_size=vocab_size,
        max_output_tokens=max_output_tokens,
    )
    prefix, colon, path = spec.partition(":")
    if colon:
        reader = TRACE_PREFIXES.get(prefix)
        if reader is None:
            raise ValueError(
                f"unknown trace format {prefix!r} in {spec!r}; "
                f"valid workloads: {workload_choices()}"
            )
        if not path:
            raise ValueError(f"{spec!r} names no trace file; use {prefix}:PATH")
        return reader.open(path, options, params)
    generator = WORKLOADS.get(spec)
    if generator is None:
        raise ValueError(f"unknown workload {spec!r}; valid workloads: {workload_choices()}")
    return generator(options, parse_params(generator.params_type, params, spec))


def arrival_process(workload: Workload, requests: Sequence[WorkloadRequest]) -> ArrivalProcess:
    """How ``requests`` (some of ``workload``'s, in its order) arrive at an engine: the
    workload's own process (closed-loop users) or at their ``arrival_s``."""
    own = getattr(workload, "arrival_process", None)
    return own(requests) if own is not None else OpenLoop(requests)


def closed_loop(spec: str, params: Mapping[str, object] | None) -> bool:
    """Whether the workload ``spec`` with ``params`` has closed-loop arrivals (whose times
    depend on when the engine finishes requests), without reading it."""
    prefix, colon, _ = spec.partition(":")
    users = (params or {}).get("users")
    return bool(colon) and prefix == AgenticWorkload.kind and users is not None
