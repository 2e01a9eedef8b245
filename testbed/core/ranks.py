"""Rank and fan-out rules: which KV ranks make up a chunk, which rank writes and which read
each object, and who copies between a worker's KV and the pool.

With tensor parallelism every TP rank holds its own shard of the heads, so a chunk is one
object per KV rank (KV rank = TP rank), each written and read by its own rank. With MLA the
latent KV is the same on every rank, so a chunk is one object (KV rank 0), written by TP rank 0
and read by every rank. Both sides of the connector follow these rules (the scheduler's
lookups count the readers, each worker registers its identity), as do the tools that play
workers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerIdentity:
    """One worker's place in the fan-out, as it registers with the cache server."""

    model: str
    world_size: int
    """KV world size: TP ranks without MLA, 1 with MLA (one latent copy for all ranks)."""
    kv_rank: int
    tp_size: int = 1
    tp_rank: int = 0
    mla: bool = False
    writer: bool = True
    """Whether this rank stores (with MLA only the first rank writes)."""
    transfer_mode: str = "worker"
    """worker (the worker copies between its KV and the pool), server (the server does, from
    the KV it maps: shared memory on CPU, CUDA IPC on GPU) or auto (server for CUDA KV,
    worker for CPU KV)."""

    @classmethod
    def for_rank(
        cls, model: str, tp_size: int, tp_rank: int, mla: bool, transfer_mode: str = "worker"
    ) -> WorkerIdentity:
        """TP rank ``tp_rank``'s identity: its own shard of the heads (KV rank = TP rank), or
        with MLA the one latent copy all ranks share (KV rank 0, written by rank 0)."""
        return cls(
            model=model,
            world_size=kv_world_size(tp_size, mla),
            kv_rank=0 if mla else tp_rank,
            tp_size=tp_size,
            tp_rank=tp_rank,
            mla=mla,
            writer=tp_rank == 0 or not mla,
            transfer_mode=transfer_mode,
        )


def kv_world_size(tp_size: int, mla: bool) -> int:
    """KV ranks whose objects make up a chunk: every TP rank's shard, or one MLA latent."""
    return 1 if mla else tp_size


def readers_per_object(tp_size: int, mla: bool) -> int:
    """Ranks that read each object: its own rank, or with MLA every TP rank."""
    return tp_size if mla else 1


def resolve_transfer_mode(mode: str, device_type: str) -> str:
    """``auto`` follows the device: the server copies CUDA KV (CUDA IPC), the worker copies
    CPU KV; ``worker`` and ``server`` are kept."""
    if mode != "auto":
        return mode
    return "server" if device_type == "cuda" else "worker"
