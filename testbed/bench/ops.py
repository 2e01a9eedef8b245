"""Whole cache operations against memcpy, and tracing's cost per operation.

**Store and retrieve against memcpy.** One 256-token chunk of a Llama-3-8B-shaped KV (32
MiB, vLLM's CPU layout, blocks of 32 tokens) stored into a real cache server and retrieved
from it into other blocks by our connector's clients, each operation timed whole: its round
trips (plan, then commit or end), the copy and the bookkeeping. The baseline is one
``numpy.copyto`` of the same bytes making the same moves as the operation, in the same round:
in, from the chunk's KV into the next region of a prefaulted shared-memory buffer as large as
the pool's slots (the store writes a new slot of the pool, shared memory too, each round); out,
from that region into other KV blocks (the retrieve reads the slot just stored). The figure is
memcpy's time over the operation's: 1.0 is memcpy's speed. The table also shows memcpy
between the same two buffers every round (``same buffers``): what a copy costs when both ends
stay in the processor's cache, which no store's new slot does.

**Tracing per operation.** Two servers, one tracing to span files and one with tracing off;
rounds alternate between them (the engine's spans on and off with them), each timing one
cycle of a small (tiny profile) KV: lookup, store, end of session, a partial engine hit whose
locks are released, retrieve.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from testbed.bench.cache_driver import CacheDriver, OpTimes
from testbed.bench.config import BenchConfig, SectionResult, Table
from testbed.bench.figures import Figure
from testbed.bench.stats import Ratio, Spread

if TYPE_CHECKING:
    from testbed.models.profiles import KVProfile

CHUNK_TOKENS = 256
SAME_BUFFERS = ("memcpy in, same buffers", "memcpy out, same buffers")
OPS = ("lookup", "store", "end_session", "lock_release", "retrieve")


def section(config: BenchConfig) -> SectionResult:
    figures, table = store_retrieve(config)
    per_op = tracing_per_op(config)
    return SectionResult(figures, [table, per_op])


def store_retrieve(config: BenchConfig) -> tuple[list[Figure], Table]:
    from testbed.models.profiles import get_profile

    profile = get_profile("llama3-8b")
    object_bytes = profile.bytes_per_token() * CHUNK_TOKENS
    samples = _time_store_retrieve(profile, object_bytes, config.rounds)
    size = f"{object_bytes / 2**20:.0f} MiB ({CHUNK_TOKENS} tokens of llama3-8b)"
    figures = _store_retrieve_figures(samples, size, config.rounds)
    return figures, _store_retrieve_table(samples, size, object_bytes)


def _time_store_retrieve(
    profile: KVProfile, object_bytes: int, rounds: int
) -> dict[str, list[float]]:
    """Seconds of each of ``rounds`` interleaved rounds (after one to warm up) of memcpy in,
    store, retrieve, memcpy out and the two same-buffer copies, one chunk of ``object_bytes``
    each, against a server of its own; by name in that order."""
    from server.launch import ServerProcess

    capacity = (rounds + 4) * object_bytes
    args = ["--chunk-size", str(CHUNK_TOKENS), "--capacity", str(capacity)]
    env = {"OTEL_SDK_DISABLED": "true"}
    samples: dict[str, list[float]] = {
        k: [] for k in ("memcpy in", "store", "retrieve", "memcpy out", *SAME_BUFFERS)
    }
    with (
        ServerProcess(args, env=env) as server,
        CacheDriver(server.url, server.token, profile, chunk_size=CHUNK_TOKENS, num_chunks=1) as d,
    ):
        storage = d.kv.layers[0].untyped_storage()
        kv = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
        kv_part, kv_other = kv[:object_bytes], kv[object_bytes : 2 * object_bytes]
        same = np.ones(object_bytes, dtype=np.uint8)  # touched: prefaulted
        slots = _shared_memory((rounds + 1) * object_bytes)
        for index in range(rounds + 1):  # the first round warms up
            slot = slots[index * object_bytes : (index + 1) * object_bytes]
            times = [_copy(slot, kv_part)]
            cycle = d.cycle(index)
            times += [cycle.store, cycle.retrieve, _copy(kv_other, slot)]
            times += [_copy(same, kv_part), _copy(kv_part, same)]
            if index:
                for key, value in zip(samples, times, strict=True):
                    samples[key].append(value)
    return samples


def _store_retrieve_figures(
    samples: dict[str, list[float]], size: str, rounds: int
) -> list[Figure]:
    """``store_vs_memcpy`` and ``retrieve_vs_memcpy``: memcpy's time over the operation's."""
    store = Ratio.of(samples["memcpy in"], samples["store"])
    retrieve = Ratio.of(samples["memcpy out"], samples["retrieve"])
    what = (
        "memcpy's time over a whole {op} of one {size} chunk by our worker client against a "
        "real server (round trips, copy and bookkeeping), {rounds} interleaved rounds; memcpy "
        "moves the same bytes {moves}; 1.0 is memcpy's speed"
    )
    moves = {
        "store": "from the KV into a new region of prefaulted shared memory each round",
        "retrieve": "from that region into other KV blocks",
    }
    return [
        Figure.of(
            "store_vs_memcpy",
            store,
            what.format(op="store", size=size, rounds=rounds, moves=moves["store"]),
        ),
        Figure.of(
            "retrieve_vs_memcpy",
            retrieve,
            what.format(op="retrieve", size=size, rounds=rounds, moves=moves["retrieve"]),
        ),
    ]


def _store_retrieve_table(samples: dict[str, list[float]], size: str, object_bytes: int) -> Table:
    """Every timed move's min, median and max and its median speed."""
    rows = [
        (
            name,
            *(f"{v * 1e3:.2f}" for v in (s.min, s.median, s.max)),
            f"{object_bytes / s.median / 1e9:.2f}",
        )
        for name, s in ((n, Spread.of(v)) for n, v in samples.items())
    ]
    return Table(
        f"Whole operations on a {size} chunk",
        ("operation", "min ms", "median ms", "max ms", "GB/s"),
        rows,
        "memcpy in / out: the same moves as the store and the retrieve (a new region of "
        "prefaulted shared memory each round, then from it into other KV blocks), the ratios' "
        "baselines; same buffers: memcpy between one heap buffer and the KV every round (both "
        "stay in the processor's cache), for comparison",
    )


def tracing_per_op(config: BenchConfig) -> Table:
    from server.launch import ServerProcess
    from testbed.core import telemetry
    from testbed.core.telemetry.setup import TracingConfig, configure_tracing
    from testbed.models.profiles import get_profile

    rounds = 5 if config.quick else 200
    work = config.work_dir / "tracing-per-op"
    common = ["--chunk-size", str(CHUNK_TOKENS), "--capacity", "1GiB"]
    profile = get_profile("tiny")
    samples: dict[str, dict[str, list[float]]] = {m: {op: [] for op in OPS} for m in ("off", "on")}
    with (
        ServerProcess(common, env={"OTEL_SDK_DISABLED": "true"}) as off_server,
        ServerProcess([*common, "--run-dir", str(work)]) as on_server,
        CacheDriver(
            off_server.url, off_server.token, profile, chunk_size=CHUNK_TOKENS, num_chunks=4
        ) as off,
        CacheDriver(
            on_server.url, on_server.token, profile, chunk_size=CHUNK_TOKENS, num_chunks=4
        ) as on,
    ):
        tracing = configure_tracing(TracingConfig("bench-engine", run_dir=work))
        try:
            for index in range(rounds + 1):
                telemetry.use_provider(None)
                off_times = off.cycle(index, engine_hit_chunks=1)
                if tracing is not None:
                    telemetry.use_provider(tracing.provider)
                on_times = on.cycle(index, engine_hit_chunks=1)
                if index:
                    _record(samples["off"], off_times)
                    _record(samples["on"], on_times)
        finally:
            if tracing is not None:
                tracing.shutdown()
    rows = []
    for op in OPS:
        off_s, on_s = Spread.of(samples["off"][op]), Spread.of(samples["on"][op])
        rows.append(
            (
                op,
                f"{off_s.median * 1e3:.3f}",
                f"{on_s.median * 1e3:.3f}",
                f"{(on_s.median - off_s.median) * 1e6:+.0f}",
                f"{on_s.median / off_s.median:.2f}",
            )
        )
    return Table(
        "Tracing per client operation (goal: ≤ 30 µs per operation)",
        ("operation", "off p50 ms", "on p50 ms", "delta µs", "on / off"),
        rows,
        f"{rounds} alternating rounds, one cache cycle of 4 tiny-profile chunks each",
    )


def _record(samples: dict[str, list[float]], times: OpTimes) -> None:
    for op in OPS:
        value = getattr(times, op)
        if value is not None:
            samples[op].append(value)


def _shared_memory(size: int) -> np.ndarray:
    """Prefaulted anonymous shared memory (the medium of the server's pool) as a numpy array;
    unmapped when the array and its views are gone."""
    import mmap

    array = np.frombuffer(mmap.mmap(-1, size, flags=mmap.MAP_SHARED), dtype=np.uint8)
    array.fill(1)  # every page written once: no page fault inside a timed copy
    return array


def _copy(dst: np.ndarray, src: np.ndarray) -> float:
    """Seconds of one ``numpy.copyto``."""
    import time

    started = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - started
