"""What a run will need from this machine, estimated and checked before it starts.

Runs in the ``kvtb run`` process, before anything is written (``testbed.run.prepare_run``).
A run holds three large things:

- the **workload** in memory: its prompt and output tokens, about
  :data:`WORKLOAD_BYTES_PER_TOKEN` bytes each once the engine holds them as vLLM requests;
- **vLLM's own KV pool** (replay and vllm engines): ``engine_blocks × block_size`` tokens of
  KV on every TP rank, allocated when the engine starts;
- the **cache pool** of the run's own server (none with ``--server``, ``metadata_only`` or the
  oracle): its capacity, or for an unlimited cache every prompt token once plus 64 MiB,
  reserved when the server starts, in ``/dev/shm`` (``pool_medium = "shm"``: memory too) or
  on disk (``"disk"``).

:func:`check` refuses a run whose estimate exceeds what the machine has (``MemAvailable``,
the free bytes of ``/dev/shm`` or of the pool's directory, and room for the run directory),
naming every part and what to lower, so that a spec that cannot run fails in a second with
nothing written instead of after minutes of swapping, with a ``SIGBUS`` or an allocation
error. Estimates are deliberately rough (the workload's bytes per token are a measured
order of magnitude, not an exact count).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from testbed.core.owned_files import free_bytes
from testbed.core.protocol import PoolMedium
from testbed.core.sizes import format_bytes

if TYPE_CHECKING:
    from testbed.spec.runspec import RunSpec
    from testbed.workloads.base import RequestShape

WORKLOAD_BYTES_PER_TOKEN = 48
"""Bytes one workload token costs in memory once an engine holds it (a numpy int32 and a
Python int in vLLM's request), an estimate."""
UNLIMITED_HEADROOM_BYTES = 64 << 20
"""What an unlimited cache gets beyond every prompt token stored once."""
RUN_DIR_RESERVE_BYTES = 8 << 20
"""Disk kept free under the run directory for its summary (``testbed.run``)."""
SHM_DIR = Path("/dev/shm")


@dataclass(frozen=True)
class Footprint:
    """A run's estimated needs, in bytes."""

    workload_bytes: int
    engine_kv_bytes: int
    pool_bytes: int
    """The cache pool (0: the run starts no server with a pool)."""
    pool_medium: PoolMedium | None
    num_requests: int
    tokens_per_request: float

    @property
    def memory_bytes(self) -> int:
        """Of it, what takes memory (a shm pool does; a disk pool does not)."""
        pool = self.pool_bytes if self.pool_medium == "shm" else 0
        return self.workload_bytes + self.engine_kv_bytes + pool


def unlimited_capacity(prompt_tokens: int, bytes_per_token: int) -> int:
    """A capacity no run of these prompts can fill: every prompt token stored once."""
    return prompt_tokens * bytes_per_token + UNLIMITED_HEADROOM_BYTES


def estimate(
    *,
    num_requests: int,
    sample_tokens: Sequence[tuple[int, int]],
    engine_kv_bytes: int,
    capacity_bytes: int | None,
    bytes_per_token: int,
    pool_medium: PoolMedium | None,
    pools: int = 1,
) -> Footprint:
    """The footprint of ``num_requests`` requests like ``sample_tokens`` (prompt, output
    tokens per request); ``capacity_bytes`` ``None`` is an unlimited cache, ``pool_medium``
    ``None`` no cache pool of the run's own; ``pools``: how many cache servers the run starts
    (a fleet's server per instance)."""
    count = max(1, len(sample_tokens))
    prompt = sum(p for p, _ in sample_tokens) / count
    total = sum(p + o for p, o in sample_tokens) / count
    pool = 0
    if pool_medium is not None:
        pool = capacity_bytes or unlimited_capacity(int(prompt * num_requests), bytes_per_token)
        pool *= pools
    return Footprint(
        workload_bytes=int(total * num_requests * WORKLOAD_BYTES_PER_TOKEN),
        engine_kv_bytes=engine_kv_bytes,
        pool_bytes=pool,
        pool_medium=pool_medium,
        num_requests=num_requests,
        tokens_per_request=total,
    )


def check(footprint: Footprint, out_dir: Path, pool_dir: Path | None = None) -> None:
    """``ValueError`` naming what does not fit on this machine (nothing if all fits)."""
    problems = []
    available = available_memory_bytes()
    if available is not None and footprint.memory_bytes > available:
        problems.append(
            f"it needs about {format_bytes(footprint.memory_bytes)} of memory and "
            f"{format_bytes(available)} is available ({_parts(footprint)}); lower requests, "
            "engine_blocks or the cache capacity"
        )
    if footprint.pool_medium is not None and footprint.pool_bytes:
        where = SHM_DIR if footprint.pool_medium == "shm" else pool_dir or _temp_dir()
        free = free_bytes(where)
        if free is not None and footprint.pool_bytes > free:
            problems.append(
                f"its cache pool of {format_bytes(footprint.pool_bytes)} does not fit in "
                f"{where} ({format_bytes(free)} free); give a smaller capacity_tokens or "
                "capacity_bytes"
                + (
                    ", or pool_medium = 'disk' (a disk-backed pool, recorded as such)"
                    if footprint.pool_medium == "shm"
                    else ""
                )  # fmt: skip
            )
    room = free_bytes(_existing_parent(out_dir))
    if room is not None and room < RUN_DIR_RESERVE_BYTES:
        problems.append(
            f"{out_dir} has {format_bytes(room)} free; a run needs at least "
            f"{format_bytes(RUN_DIR_RESERVE_BYTES)} there for its results"
        )
    if problems:
        raise ValueError("this run does not fit on this machine: " + "; ".join(problems))


def available_memory_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` (``None`` where there is none)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _parts(footprint: Footprint) -> str:
    parts = [
        f"workload ~{format_bytes(footprint.workload_bytes)}: {footprint.num_requests:,} "
        f"requests of ~{footprint.tokens_per_request:,.0f} tokens",
        f"vLLM's KV pool ~{format_bytes(footprint.engine_kv_bytes)}",
    ]
    if footprint.pool_medium == "shm" and footprint.pool_bytes:
        parts.append(f"cache pool {format_bytes(footprint.pool_bytes)} in {SHM_DIR}")
    return ", ".join(parts)


def _existing_parent(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _temp_dir() -> Path:
    return Path(tempfile.gettempdir())


SAMPLE_REQUESTS = 32
"""Requests read to estimate the rest before the whole workload is loaded."""


def check_run(
    spec: RunSpec,
    requests: Sequence[RequestShape],
    bytes_per_token: int,
    *,
    own_server: bool,
    out_dir: Path,
    engine_kv_bytes: Callable[[RunSpec, int, int], int] | None = None,
    exact: bool = False,
) -> None:
    """Checks a run of ``spec`` against this machine (:func:`check`): on all its requests
    (``exact``), or on its first ones, extrapolated to ``spec.requests``. ``bytes_per_token``:
    what the cache stores per token; ``own_server``: whether the run starts its server;
    ``engine_kv_bytes``: the memory of the engine's own KV pool for (spec, blocks, bytes per
    token), ``None`` for an engine without one."""
    if not requests:
        return  # nothing to check: loading the workload says it is empty
    tokens = [(r.num_prompt_tokens, r.max_output_tokens) for r in requests]
    num_requests = len(tokens) if exact or spec.requests is None else spec.requests
    capacity = spec.capacity_bytes
    if capacity is None and spec.capacity_tokens is not None:
        capacity = spec.capacity_tokens * bytes_per_token
    medium: PoolMedium | None = None
    if own_server and not spec.metadata_only:
        medium = "disk" if spec.pool_medium == "disk" else "shm"
    footprint = estimate(
        num_requests=num_requests,
        sample_tokens=tokens,
        engine_kv_bytes=0
        if engine_kv_bytes is None
        else engine_kv_bytes(spec, pool_blocks(spec, requests), bytes_per_token),
        capacity_bytes=capacity,
        bytes_per_token=bytes_per_token,
        pool_medium=medium,
        pools=spec.instances if spec.servers == "per-instance" else 1,
    )
    check(footprint, out_dir)


POOL_REQUESTS = 2
"""A pool sized from the workload holds its longest request this many times over."""


def pool_blocks(spec: RunSpec, requests: Sequence[RequestShape]) -> int:
    """vLLM's KV pool for ``requests``, in blocks: the spec's ``engine_blocks``, or, when it
    leaves that to the workload, room for the longest request :data:`POOL_REQUESTS` times over
    plus vLLM's null block."""
    if spec.engine_blocks is not None:
        return spec.engine_blocks
    longest = max(r.num_prompt_tokens + r.max_output_tokens for r in requests)
    return POOL_REQUESTS * -(-longest // spec.block_size) + 1
