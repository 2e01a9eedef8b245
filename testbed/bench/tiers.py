"""``kvtb bench``'s ``tiers`` section: the disk tier's real bandwidth, and a promotion's cost.

Three measurements in one run, in one directory (``--out``'s ``work/tiers``, on the filesystem
the bench writes to), interleaved round by round so that the machine's load falls on all alike:

- **the disk tier** (``server.tiers.disk.DiskStore``: one file per object, written to a
  temporary name and renamed into place, each fsynced) writing and then reading ``N`` framed
  chunks of one llama3-8b chunk size;
- **a dd-style baseline**: the same bytes as one file, written in chunk-sized blocks with one
  fsync at the end, then read back in the same blocks (what ``dd bs=CHUNK conv=fsync`` does);
- **a promotion**: one object read from the disk tier, verified (its checksum) and copied into
  a shared-memory region, against ``memcpy`` of the same bytes between two such regions.

Reads go through the page cache unless the kernel drops the files' pages first: after each
write the bench asks it to (``posix_fadvise(DONTNEED)``, where the OS has it), and says in the
table whether it could; with the pages cached a "disk" read is a memory copy, which is what a
server with free memory sees too. METRICS.md ("Time per link") uses the measured rates in
place of a datasheet's when a profile is calibrated.
"""

from __future__ import annotations

import mmap
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from testbed.bench.config import BenchConfig, SectionResult, Table
from testbed.bench.figures import Figure
from testbed.bench.stats import Ratio, Spread
from testbed.core.keys import ChunkHash

if TYPE_CHECKING:
    from server.tiers.disk import DiskStore

CHUNK_TOKENS = 256
QUICK_CHUNK_TOKENS = 16
"""``--quick``: 2 MiB chunks (the figures mean little; the section runs in seconds)."""
OBJECTS_QUICK, OBJECTS_FULL = 8, 64
"""Objects written and read per round (``--quick``, full)."""
_FADVISE = hasattr(os, "posix_fadvise")


def section(config: BenchConfig) -> SectionResult:
    from testbed.models.profiles import get_profile

    tokens = QUICK_CHUNK_TOKENS if config.quick else CHUNK_TOKENS
    object_bytes = get_profile("llama3-8b").bytes_per_token() * tokens
    work = config.work_dir / "tiers"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    count = OBJECTS_QUICK if config.quick else OBJECTS_FULL
    try:
        samples = _rounds(work, object_bytes, config.rounds, count)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return _result(samples, object_bytes, count, config.rounds, tokens)


def _rounds(work: Path, object_bytes: int, rounds: int, count: int) -> dict[str, list[float]]:
    from server.tiers.disk import DiskStore
    from server.tiers.framing import frame

    rng = np.random.default_rng(0)
    payload = rng.integers(0, 256, object_bytes, dtype=np.uint8).tobytes()
    samples: dict[str, list[float]] = {
        k: [] for k in ("tier write", "tier read", "dd write", "dd read", "promotion", "memcpy")
    }
    source, target = mmap.mmap(-1, object_bytes), mmap.mmap(-1, object_bytes)
    source[:] = payload
    for index in range(rounds + 1):  # the first round warms up
        store = DiskStore(work / f"tier{index}", capacity_bytes=2 * count * (object_bytes + 64),
                          fsync=True)  # fmt: skip
        keys = [ChunkHash(index.to_bytes(4, "big") + i.to_bytes(12, "big")) for i in range(count)]
        framed = [frame(key, payload) for key in keys]
        times = [_tier_write(store, keys, framed), _tier_read(store, keys)]
        times += _dd(work / f"dd{index}.bin", payload, count)
        times += [_promotion(store, keys[0], target), _memcpy(source, target)]
        store.close()
        if index:
            for name, value in zip(samples, times, strict=True):
                samples[name].append(value)
    return samples


def _tier_write(store: DiskStore, keys: list[ChunkHash], framed: list[bytes]) -> float:
    started = time.perf_counter()
    for key, data in zip(keys, framed, strict=True):
        if not store.write(key, data):
            raise OSError(f"the disk tier refused a write: {store.last_failure}")
    elapsed = time.perf_counter() - started
    for key in keys:
        _drop_cache(store._path(key))
    return elapsed


def _tier_read(store: DiskStore, keys: list[ChunkHash]) -> float:
    started = time.perf_counter()
    for key in keys:
        if store.read(key) is None:
            raise OSError(f"the disk tier failed a read: {store.last_failure}")
    return time.perf_counter() - started


def _dd(path: Path, block: bytes, count: int) -> list[float]:
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(count):
            os.write(fd, block)
        os.fsync(fd)
    finally:
        os.close(fd)
    written = time.perf_counter() - started
    _drop_cache(path)
    started = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.read(fd, len(block)):
            pass
    finally:
        os.close(fd)
    read = time.perf_counter() - started
    path.unlink()
    return [written, read]


def _promotion(store: DiskStore, key: ChunkHash, target: mmap.mmap) -> float:
    from server.tiers.framing import unframe

    started = time.perf_counter()
    data = store.read(key)
    payload = None if data is None else unframe(key, data)
    if payload is None:
        raise OSError("a promotion's read did not verify")
    target[: len(payload)] = payload
    return time.perf_counter() - started


def _memcpy(source: mmap.mmap, target: mmap.mmap) -> float:
    started = time.perf_counter()
    target[:] = source
    return time.perf_counter() - started


def _drop_cache(path: Path) -> None:
    if not _FADVISE:
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _result(
    samples: dict[str, list[float]], object_bytes: int, count: int, rounds: int, tokens: int
) -> SectionResult:
    total = object_bytes * count
    write = Ratio.of(samples["dd write"], samples["tier write"])
    read = Ratio.of(samples["dd read"], samples["tier read"])
    promotion = Ratio.of(samples["memcpy"], samples["promotion"])
    size = f"{count} chunks of {object_bytes / 2**20:.0f} MiB (llama3-8b, {tokens} tokens)"
    cache = "pages dropped after each write" if _FADVISE else "page cache not dropped (no fadvise)"
    figures = [
        Figure.of("disk_tier_write_vs_dd", write,
                  f"dd-style sequential write's time over the disk tier's (one fsynced file per "
                  f"object, renamed into place) for {size}, {rounds} rounds; 1.0 is dd's speed"),
        Figure.of("disk_tier_read_vs_dd", read,
                  f"dd-style sequential read's time over the disk tier's (one file per object, "
                  f"framing checked by the caller) for {size}, {rounds} rounds ({cache})"),
        Figure.of("promotion_vs_memcpy", promotion,
                  "memcpy's time over a promotion's (read one object from the disk tier, "
                  f"verify its checksum, copy it into shared memory), {rounds} rounds ({cache})"),
    ]  # fmt: skip
    rows = [
        (
            name,
            *(f"{v * 1e3:.2f}" for v in (s.min, s.median, s.max)),
            f"{(object_bytes if name in ('promotion', 'memcpy') else total) / s.median / 1e9:.2f}",
        )
        for name, s in ((n, Spread.of(v)) for n, v in samples.items())
    ]
    table = Table(
        f"The disk tier beside dd and memcpy ({size})",
        ("operation", "min ms", "median ms", "max ms", "GB/s"),
        rows,
        note=f"Measured on the filesystem of the bench's --out directory; {cache}.",
    )
    return SectionResult(figures, [table])
