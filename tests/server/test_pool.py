"""The shared-memory pool (reserved when made, mapped in on request) and its extent allocator."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from server.pool import ALIGNMENT, ExtentAllocator, SharedMemoryPool
from testbed.core.owned_files import is_owned


def test_a_pool_has_its_memory_when_made_and_prefault_keeps_the_contents():
    size = 16 << 20
    with SharedMemoryPool(size) as pool:
        assert pool.medium == "shm" and pool.path.parent == Path("/dev/shm")
        assert pool.resident_bytes() >= size  # every page reserved before any copy
        assert is_owned(pool.path)  # its owner lock marks it live for reclaim
        pool.array[12345:12349] = [1, 2, 3, 4]
        seconds = pool.prefault()
        assert seconds > 0
        assert pool.array[12345:12349].tolist() == [1, 2, 3, 4]
        assert pool.array.size == size and pool.array.flags.writeable
    assert not pool.path.exists()


def test_a_disk_pool_is_made_only_where_asked(tmp_path):
    with SharedMemoryPool(1 << 20, "disk", tmp_path) as pool:
        assert pool.path.parent == tmp_path and pool.resident_bytes() >= 1 << 20
    with pytest.raises(ValueError, match="--pool-dir goes with --pool disk"):
        SharedMemoryPool(1 << 20, "shm", tmp_path)


def test_close_removes_the_file_even_while_a_view_is_alive():
    pool = SharedMemoryPool(1 << 20)
    view = pool.array[:10]
    pool.close()
    assert not pool.path.exists()
    view[:] = 1  # the mapping stays valid while a view holds it
    pool.close()  # idempotent


class Model:
    """An independent account of which bytes are allocated, to check the allocator against."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.extents: dict[int, int] = {}

    def check_allocation(self, offset: int, length: int) -> None:
        assert offset % ALIGNMENT == 0 and offset >= 0 and offset + length <= self.size
        for other, other_length in self.extents.items():
            assert offset + length <= other or other + other_length <= offset, "overlap"
        self.extents[offset] = length

    def largest_gap(self) -> int:
        ends = sorted((o, o + n) for o, n in self.extents.items())
        cursor, best = 0, 0
        for start, end in ends:
            best = max(best, start - cursor)
            cursor = end
        return max(best, self.size - cursor)


def test_random_allocations_never_overlap_and_freeing_everything_coalesces():
    rng = random.Random(7)
    size = 1 << 20
    allocator, model = ExtentAllocator(size), Model(size)
    for _ in range(5000):
        if model.extents and rng.random() < 0.45:
            offset = rng.choice(list(model.extents))
            allocator.free(offset)
            del model.extents[offset]
        else:
            nbytes = rng.choice([64, 100, 256, 1000, 4096, 10_000])
            length = (nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
            offset = allocator.allocate(nbytes)
            if offset is None:
                assert model.largest_gap() < length  # refused only when nothing fits
            else:
                model.check_allocation(offset, length)
        assert allocator.allocated_bytes == sum(model.extents.values())
        allocator.check_invariants()
    for offset in list(model.extents):
        allocator.free(offset)
    assert allocator.allocated_bytes == 0 and allocator.num_free_extents == 0
    assert allocator.allocate(size) == 0  # one extent again: the whole pool


def test_the_smallest_free_extent_that_fits_is_taken():
    allocator = ExtentAllocator(1 << 20)
    offsets = [allocator.allocate(n) for n in (640, 64, 256, 64, 128, 64)]
    assert None not in offsets
    for index in (0, 2, 4):  # free extents of 640, 256 and 128 bytes, kept apart
        allocator.free(offsets[index])
    assert allocator.num_free_extents == 3
    assert allocator.allocate(200) == offsets[2]  # best fit: the 256-byte extent
    assert allocator.allocate(128) == offsets[4]  # exact fit
    assert allocator.allocate(64) == offsets[0]  # only the 640-byte extent is left: split
    assert allocator.allocate(576) == offsets[0] + 64  # its remainder, exactly


def _mapped_bytes(pid: int, path_part: str) -> int:
    """Bytes of ``pid``'s mappings of files whose path contains ``path_part`` that have page
    table entries now (``Rss`` in ``/proc/PID/smaps``)."""
    total, inside = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = len(fields) >= 6 and path_part in fields[5]
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


def test_a_server_maps_its_whole_pool_before_it_is_ready_whatever_its_size():
    from server.launch import ServerProcess

    size = 544 << 20  # above the 512 MiB up to which pools used to be mapped
    with ServerProcess(["--chunk-size", "64", "--capacity", str(size)]) as server:
        pid = int(server.ready["pid"])
        assert float(server.ready["prefault_ms"]) > 0
        assert _mapped_bytes(pid, "kvtb-pool-") >= size  # no request pays a first touch
    with ServerProcess(["--chunk-size", "64", "--capacity", "8MiB", "--prefault", "0"]) as server:
        assert float(server.ready["prefault_ms"]) == 0
        assert _mapped_bytes(int(server.ready["pid"]), "kvtb-pool-") < 8 << 20
