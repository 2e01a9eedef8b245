"""Both cache servers alone, the same KV shape: lookup, store and retrieve against LMCache.

No vLLM engine: each side's own client code, as its connector uses it, against its own
server (ours: :class:`~testbed.bench.cache_driver.CacheDriver`, worker copies; LMCache: its
scheduler and worker adapters in ``engine_driven`` mode, :mod:`.lmcache_alone`, in the peer
environment), one 256-token chunk of a Llama-3-8B-shaped KV (32 MiB, vLLM-CPU layout) per
cycle. Rounds alternate: an LMCache cycle, then ours. A cycle stores a new prompt's chunk,
then looks the prompt up again (a hit) and retrieves it into other blocks.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from testbed.bench.cache_driver import BLOCK_SIZE, CacheDriver
from testbed.bench.config import BenchConfig, SectionResult
from testbed.bench.figures import Figure
from testbed.bench.peer import lmcache_launch as lmcache
from testbed.bench.peer.env import PeerEnv, default_root
from testbed.bench.processes import BenchProcesses
from testbed.bench.stats import Ratio
from testbed.bench.vllm_e2e import EngineChild

if TYPE_CHECKING:
    from testbed.models.profiles import KVProfile

CHUNKS = 1
OPS = {
    "lookup_vs_lmcache": ("hit_lookup", "lookup_s", "a hit's lookup (request to answer)"),
    "store_vs_lmcache": ("store", "store_s", "a store (submitted until finished)"),
    "retrieve_vs_lmcache": ("retrieve", "retrieve_s", "a retrieve (submitted until finished)"),
}


def section(config: BenchConfig) -> SectionResult:
    from testbed.models.profiles import get_profile

    profile = get_profile("llama3-8b")
    rounds = 2 if config.quick else 20
    env = PeerEnv(config.peer_env or default_root())
    work = config.work_dir / "servers-alone"
    capacity = (rounds + 4) * CHUNKS * profile.bytes_per_token() * 256
    with BenchProcesses() as processes:
        port = lmcache.start_server(
            processes,
            env,
            work / "lmcache-server.log",
            chunk_size=256,
            l1_gib=max(1.0, 2 * capacity / 2**30),
        )
        child = _lmcache_client(processes, env, port, profile, work / "lmcache-client.log")
        child.ready()
        ours, theirs = _alternate_rounds(processes, child, profile, capacity, rounds)
        child.finish()
    return SectionResult(_figures(ours, theirs, rounds))


def _lmcache_client(
    processes: BenchProcesses, env: PeerEnv, port: int, profile: KVProfile, log_path: Path
) -> EngineChild:
    """:mod:`.lmcache_alone` in the peer environment, against LMCache's server on ``port``,
    with KV of ``profile``'s shape (not yet ready)."""
    command = [
        str(env.python),
        str(lmcache.CHILD.parent / "lmcache_alone.py"),
        "--port",
        str(port),
        "--layers",
        str(profile.num_layers),
        "--heads",
        str(profile.num_kv_heads),
        "--head-dim",
        str(profile.head_dim),
        "--block-size",
        str(BLOCK_SIZE),
        "--max-chunks",
        str(CHUNKS),
    ]
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE}
    return EngineChild(
        "LMCache alone", processes.start(command, log_path, lmcache.ENV, **pipes), log_path
    )


def _alternate_rounds(
    processes: BenchProcesses, child: EngineChild, profile: KVProfile, capacity: int, rounds: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """``rounds`` rounds (after one to warm up), each an LMCache cycle by ``child`` and then
    ours against a server of our own of ``capacity`` bytes; the seconds of each of
    :data:`OPS`' operations per round, ours and LMCache's, by field."""
    from server.launch import ServerProcess

    ours: dict[str, list[float]] = {field: [] for field, _, _ in OPS.values()}
    theirs: dict[str, list[float]] = {field: [] for _, field, _ in OPS.values()}
    args = ["--chunk-size", "256", "--capacity", str(capacity)]
    with (
        ServerProcess(args, env={"OTEL_SDK_DISABLED": "true"}) as server,
        CacheDriver(server.url, server.token, profile, chunk_size=256, num_chunks=CHUNKS) as d,
    ):
        for index in range(rounds + 1):  # the first round warms up
            reply = child.ask_line(f"{index} {CHUNKS}")
            times = d.cycle(index)
            if index:
                for field in ours:
                    ours[field].append(getattr(times, field))
                for field in theirs:
                    theirs[field].append(float(reply[field]))
            processes.note_shm_files()
            print(f"  peer_servers: round {index}/{rounds}", file=sys.stderr, flush=True)
    return ours, theirs


def _figures(
    ours: dict[str, list[float]], theirs: dict[str, list[float]], rounds: int
) -> list[Figure]:
    """Per :data:`OPS` key: ours over LMCache's time, as ``server_alone``."""
    figures = []
    for key, (mine, other, what) in OPS.items():
        ratio = Ratio.of(ours[mine], theirs[other])
        figures.append(
            Figure(
                key,
                {"server_alone": ratio.value},
                f"server alone: ours over LMCache's time for {what}, each side's own client "
                f"(worker copies) and server, one 32 MiB chunk (llama3-8b), {rounds} alternating "
                "rounds",
                ratio=ratio,
            )
        )
    return figures
