"""What one replay instance runs with (the replay engine's, and each instance of a fleet's):
a module of its own so that the instance, the engine and the virtual clock all read it without
importing each other."""

from __future__ import annotations

from dataclasses import dataclass

from testbed.engine.engine_spec import EngineSpec
from testbed.models.profiles import KVProfile
from testbed.models.time_model import TimeModel, make_time_model


@dataclass(frozen=True)
class ReplaySpec(EngineSpec):
    """The run's spec (``run``: its KV profile, chunk and block sizes, TP, vLLM's limits, the
    connector's modes, the time model, fault injection, metadata only) and the replay's own
    switches. The spec's ``arrival``: ``trace``, requests enter as their arrival process
    releases them on the virtual clock (their times, or closed-loop users); ``all``, at once."""

    log_stats: bool = False
    """vLLM's scheduler makes its per-step stats (prefix cache, connector stats), as in a
    server; the scheduler's outputs carry them (``execute``)."""
    kv_events: bool = False
    """vLLM's KV events, the connector's included (``SchedulerSpec.kv_events``)."""

    def __post_init__(self) -> None:
        if self.run.arrival not in ("trace", "all"):
            raise ValueError(f"arrival must be 'trace' or 'all', got {self.run.arrival!r}")
        self.profile.heads_per_rank(self.run.tp)  # raises if TP cannot split the heads

    @property
    def profile(self) -> KVProfile:
        """The KV shape the worker harnesses write (the spec's profile, or its MLA variant)."""
        return self.run.kv_profile

    def time_model(self) -> TimeModel:
        """The projected clock: the spec's ``time_profile`` charging its compute model."""
        run = self.run
        return make_time_model(
            run.time_profile, run.compute_profile, tp=run.tp, chunk_size=run.chunk_size
        )
