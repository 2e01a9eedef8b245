"""Pool allocator cost per allocate/free pair as the free list grows.

Fragments a pool into ``N`` free extents of distinct lengths (odd multiples of 64 bytes, kept
apart by small live objects), then times allocate + free of an object that fits only the
largest free extent and none exactly, the worst case for a best-fit search. A time per pair
that stays flat as ``N`` grows a hundredfold is the ``O(log n)`` the allocator promises (the
previous allocator sorted the free lengths on every allocation: 92 µs at 1,000 free extents,
740 µs at 10,000 on the 2-core development machine).

    python -m testbed.bench.pool_allocator [--extents 1000 10000 100000]
"""

from __future__ import annotations

import argparse
import time

from server.pool import ALIGNMENT, ExtentAllocator
from testbed.bench.tables import table


def fragmented(num_free: int) -> tuple[ExtentAllocator, int]:
    """An allocator with ``num_free`` free extents of distinct lengths; the largest length."""
    lengths = [ALIGNMENT * (2 * index + 1) for index in range(num_free)]  # odd multiples
    size = 2 * sum(lengths) + (1 << 20)
    allocator = ExtentAllocator(size)
    pairs = []
    for length in lengths:
        pairs.append((allocator.allocate(length), allocator.allocate(ALIGNMENT)))
    for free_offset, _ in pairs:
        assert free_offset is not None
        allocator.free(free_offset)
    assert allocator.num_free_extents == num_free
    return allocator, lengths[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--extents", type=int, nargs="+", default=[1000, 10_000, 100_000])
    parser.add_argument("--pairs", type=int, default=20_000)
    args = parser.parse_args()
    rows = []
    for num_free in args.extents:
        allocator, largest = fragmented(num_free)
        nbytes = largest - ALIGNMENT  # an even multiple: no exact fit, only the largest fits
        started = time.perf_counter()
        for _ in range(args.pairs):
            offset = allocator.allocate(nbytes)
            assert offset is not None
            allocator.free(offset)
        per_pair_us = (time.perf_counter() - started) / args.pairs * 1e6
        rows.append((f"{num_free:,}", f"{per_pair_us:.2f}"))
    print(f"allocate + free of a best-fit object, {args.pairs:,} pairs")
    print(table(rows, ("free extents", "µs per pair")))


if __name__ == "__main__":
    main()
