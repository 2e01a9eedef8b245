"""What one replay instance runs with (the replay engine's, and each instance of a fleet's):
a module of its own so that the instance, the engine and the virtual clock all read it without
importing each other."""

from __future__ import annotations

from dataclasses import dataclass

from testbed.models.profiles import KVProfile
from testbed.models.time_model import TimeModel, make_time_model


@dataclass(frozen=True)
class ReplaySpec:
    profile: KVProfile
    chunk_size: int = 256
    tp: int = 1
    block_size: int = 64
    engine_blocks: int = 8192
    """vLLM's KV pool in blocks (small pools cause preemption)."""
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 64
    max_model_len: int = 8192
    load_async: bool = True
    prefix_caching: bool = True
    log_stats: bool = False
    """vLLM's scheduler makes its per-step stats (prefix cache, connector stats), as in a
    server; the scheduler's outputs carry them (``execute``)."""
    kv_events: bool = False
    """vLLM's KV events, the connector's included (``SchedulerSpec.kv_events``)."""
    transfer_mode: str = "worker"
    store_wait: bool = True
    """Each step's stores commit before the step reports (``kvtb.store_wait_s``)."""
    arrival: str = "trace"
    """``trace``: requests enter as their arrival process releases them on the virtual clock
    (their times, or closed-loop users); ``all``: at once."""
    time_profile: str = "flat"
    """The projected clock's hardware (``testbed.models.time_model``): flat, h100, ..."""
    compute_profile: KVProfile | None = None
    """The model the clock charges (``None``: ``profile``; it needs a compute shape unless
    the clock is flat)."""
    fault_drop_fraction: float = 0.0
    """Fault injection (the connector's ``kvtb.fault_drop_fraction``): share of retrieves
    whose first chunk is dropped from the server just before the retrieve."""
    seed: int = 0
    metadata_only: bool = False
    timeout_s: float = 30.0
    run_id: str = "replay"

    def __post_init__(self) -> None:
        if self.arrival not in ("trace", "all"):
            raise ValueError(f"arrival must be 'trace' or 'all', got {self.arrival!r}")
        if self.chunk_size % self.block_size:
            raise ValueError(
                f"chunk size {self.chunk_size} must be a multiple of the block size "
                f"{self.block_size}"
            )
        if not 0.0 <= self.fault_drop_fraction <= 1.0:
            raise ValueError("fault_drop_fraction must be in [0, 1]")
        self.profile.heads_per_rank(self.tp)  # raises if TP cannot split the heads

    def time_model(self) -> TimeModel:
        return make_time_model(
            self.time_profile,
            self.compute_profile or self.profile,
            tp=self.tp,
            chunk_size=self.chunk_size,
        )
