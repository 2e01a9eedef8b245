"""A run's plan: everything it needs, checked before any work (plain data;
:mod:`testbed.run.prepare` makes it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from testbed.core import protocol as p
from testbed.spec.runspec import RunSpec
from testbed.workloads import (
    ArrivalProcess,
    BlockRequest,
    OpenLoop,
    Workload,
    WorkloadRequest,
    arrival_process,
)


@dataclass(frozen=True)
class RunPlan:
    """Everything a run needs, checked before any work: the requests and the server."""

    spec: RunSpec
    requests: list[WorkloadRequest]
    rejected: list[str]
    server_info: p.ServerConfigInfo | None
    """The external server's configuration (``None``: the run starts its own)."""
    bytes_per_token: int
    """KV bytes the cache stores per token for this spec's model (all TP ranks)."""
    own_server: bool = False
    """Whether the run starts its own cache server."""
    workload: Workload | None = None
    """What the requests came from (it says how they arrive: :meth:`arrivals`)."""
    blocks: list[BlockRequest] | None = None
    """The oracle over a block-hash trace: the servable requests as block ids, no token
    synthesised (``requests`` is then empty)."""

    @property
    def served(self) -> Sequence[WorkloadRequest] | Sequence[BlockRequest]:
        """The servable requests, as tokens or as block ids."""
        return self.blocks if self.blocks is not None else self.requests

    def arrivals(self) -> ArrivalProcess[WorkloadRequest]:
        """A fresh arrival process over ``requests`` (closed-loop users, or their times)."""
        if self.workload is None:
            return OpenLoop(self.requests)
        return arrival_process(self.workload, self.requests)

    @property
    def capacity_bytes(self) -> int | None:
        """The cache capacity the spec asks for, in bytes of this run's model."""
        return asked_capacity(self.spec, self.bytes_per_token)

    @property
    def pool_medium(self) -> str | None:
        """Where the run's cache pool lives (an external server's answer); ``None``: no pool
        of a server the run knows (metadata only, the oracle, a vLLM server's own)."""
        if self.server_info is not None:
            return self.server_info.pool_medium
        if not self.own_server or self.spec.metadata_only:
            return None
        return self.spec.pool_medium


def asked_capacity(spec: RunSpec, bytes_per_token: int) -> int | None:
    """The cache capacity ``spec`` asks for, in bytes of a model of ``bytes_per_token``
    (``None``: unlimited)."""
    if spec.capacity_bytes is not None:
        return spec.capacity_bytes
    if spec.capacity_tokens is not None:
        return spec.capacity_tokens * bytes_per_token
    return None
