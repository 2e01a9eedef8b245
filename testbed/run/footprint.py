"""What a run will need from this machine, estimated and checked before it starts.

Runs in the ``kvtb run`` process, before anything is written (``testbed.run.prepare_run``).
A run holds three large things:

- the **workload** in memory, for as many requests as the workload yields (capped by
  ``requests``; a trace shorter than that is all of it). An engine that makes tokens holds
  each prompt and output token, about :data:`WORKLOAD_BYTES_PER_TOKEN` bytes each once the
  engine holds them as vLLM requests. A block-key engine over a block-hash trace (the oracle on
  ``mooncake:`` or ``agentic:``, ``EngineEntry.block_ids``) makes no token: it holds the
  trace's block ids, :data:`BLOCK_ID_BYTES` each, and one key per chunk of every prompt,
  :data:`CHUNK_KEY_BYTES` each (``testbed.workloads.block_keys``, the simulation's lists);
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
error; a run that fits is never refused. Estimates are deliberately rough (the bytes per
token, id and key are measured orders of magnitude, rounded up, not exact counts).
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from testbed.core.owned_files import free_bytes
from testbed.core.protocol import PoolMedium
from testbed.core.sizes import format_bytes

if TYPE_CHECKING:
    from testbed.spec.runspec import RunSpec
    from testbed.workloads.base import RequestShape
    from testbed.workloads.block_trace import BlockRequest

WORKLOAD_BYTES_PER_TOKEN = 48
"""Bytes one workload token costs in memory once an engine holds it (a numpy int32 and a
Python int in vLLM's request), an estimate."""
BLOCK_ID_BYTES = 40
"""Bytes one block id of a block-hash trace costs a block-key engine: its int64 in the
request, and the numbering of id prefixes (measured about 35 on the shipped agentic traces)."""
CHUNK_KEY_BYTES = 120
"""Bytes one chunk key costs a block-key engine at its peak: the access trace's arrays and the
cache simulations' per-request lists (measured 60-115 on the shipped agentic traces for an LRU
oracle run, which simulates twice: at its capacity and unlimited)."""
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
    keys_only: bool = False
    """The workload is held as block ids and chunk keys, not tokens (a block-key engine)."""

    @property
    def memory_bytes(self) -> int:
        """Of it, what takes memory (a shm pool does; a disk pool does not)."""
        pool = self.pool_bytes if self.pool_medium == "shm" else 0
        return self.workload_bytes + self.engine_kv_bytes + pool


def unlimited_capacity(prompt_tokens: int, bytes_per_token: int) -> int:
    """A capacity no run of these prompts can fill: every prompt token stored once."""
    return prompt_tokens * bytes_per_token + UNLIMITED_HEADROOM_BYTES


def token_bytes(request: RequestShape) -> int:
    """What an engine that makes tokens holds of ``request``: its prompt and output."""
    return (request.num_prompt_tokens + request.max_output_tokens) * WORKLOAD_BYTES_PER_TOKEN


def key_bytes(request: BlockRequest, chunk_size: int) -> int:
    """What a block-key engine holds of ``request``: its block ids and one key per chunk."""
    chunks = request.num_prompt_tokens // chunk_size
    return len(request.block_ids) * BLOCK_ID_BYTES + chunks * CHUNK_KEY_BYTES


def estimate(
    *,
    num_requests: int,
    sample: Sequence[RequestShape],
    held_bytes: Callable[[Any], int],
    engine_kv_bytes: int,
    capacity_bytes: int | None,
    bytes_per_token: int,
    pool_medium: PoolMedium | None,
    pools: int = 1,
    keys_only: bool = False,
) -> Footprint:
    """The footprint of ``num_requests`` requests like ``sample``, each holding
    ``held_bytes(request)`` (:func:`token_bytes`, or :func:`key_bytes` with ``keys_only``);
    ``capacity_bytes`` ``None`` is an unlimited cache, ``pool_medium`` ``None`` no cache pool
    of the run's own; ``pools``: how many cache servers the run starts (a fleet's server per
    instance)."""
    count = max(1, len(sample))
    prompt = sum(r.num_prompt_tokens for r in sample) / count
    total = sum(r.num_prompt_tokens + r.max_output_tokens for r in sample) / count
    held = sum(held_bytes(r) for r in sample) / count
    pool = 0
    if pool_medium is not None:
        pool = capacity_bytes or unlimited_capacity(int(prompt * num_requests), bytes_per_token)
        pool *= pools
    return Footprint(
        workload_bytes=int(held * num_requests),
        engine_kv_bytes=engine_kv_bytes,
        pool_bytes=pool,
        pool_medium=pool_medium,
        num_requests=num_requests,
        tokens_per_request=total,
        keys_only=keys_only,
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
    held = " held as block ids and chunk keys" if footprint.keys_only else ""
    parts = [
        f"workload ~{format_bytes(footprint.workload_bytes)}: {footprint.num_requests:,} "
        f"requests of ~{footprint.tokens_per_request:,.0f} tokens{held}",
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
"""Requests of a generated workload read to estimate the rest before all are made."""


def check_run(
    spec: RunSpec,
    requests: Sequence[RequestShape],
    bytes_per_token: int,
    *,
    own_server: bool,
    out_dir: Path,
    engine_kv_bytes: Callable[[RunSpec, int, int], int] | None = None,
    num_requests: int | None = None,
    keys_only: bool = False,
) -> None:
    """Checks a run of ``spec`` against this machine (:func:`check`): on all its requests,
    or (``num_requests``: how many the workload will yield, capped by ``spec.requests``) on
    its first ones, extrapolated. ``keys_only``: ``requests`` are block requests held as keys
    (a block-key engine), not tokens. ``bytes_per_token``: what the cache stores per token;
    ``own_server``: whether the run starts its server; ``engine_kv_bytes``: the memory of the
    engine's own KV pool for (spec, blocks, bytes per token), ``None`` for an engine without
    one."""
    if not requests:
        return  # nothing to check: loading the workload says it is empty
    capacity = spec.capacity_bytes
    if capacity is None and spec.capacity_tokens is not None:
        capacity = spec.capacity_tokens * bytes_per_token
    medium: PoolMedium | None = None
    if own_server and not spec.metadata_only:
        medium = "disk" if spec.pool_medium == "disk" else "shm"
    held = functools.partial(key_bytes, chunk_size=spec.chunk_size) if keys_only else token_bytes
    footprint = estimate(
        num_requests=len(requests) if num_requests is None else num_requests,
        sample=requests,
        held_bytes=held,
        engine_kv_bytes=0
        if engine_kv_bytes is None
        else engine_kv_bytes(spec, pool_blocks(spec, requests), bytes_per_token),
        capacity_bytes=capacity,
        bytes_per_token=bytes_per_token,
        pool_medium=medium,
        pools=spec.instances if spec.servers == "per-instance" else 1,
        keys_only=keys_only,
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
