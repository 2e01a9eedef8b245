"""The peak resident memory of a process and all its descendants, sampled while it runs.

``wait4`` reports a child's own peak and that of the children it waited for, but not of those
it started in sessions of their own and did not wait for (a cache server, a fork server's
workers). :class:`TreePeak` sums the resident set (``/proc/PID/statm``) of a process and
every process descended from it every :data:`INTERVAL_S`, on a thread, and keeps the largest
sum: an upper bound where processes share pages (each counts them), a lower bound between
samples.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from testbed.core.process_groups import proc_stats

INTERVAL_S = 0.25
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def tree_rss_bytes(root: int) -> int:
    """Resident bytes of ``root`` and its descendants now (0 when it is gone)."""
    parents = {pid: int(fields[1]) for pid, fields in proc_stats()}
    tree, frontier = {root}, [root]
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    while frontier:
        for child in children.get(frontier.pop(), []):
            if child not in tree:
                tree.add(child)
                frontier.append(child)
    total = 0
    for pid in tree:
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE_BYTES
        except (OSError, IndexError, ValueError):
            continue
    return total


class TreePeak:
    """Samples :func:`tree_rss_bytes` of ``root`` until closed; :attr:`peak_bytes`."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="kvtb-peak-rss", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, tree_rss_bytes(self.root))
            self._stop.wait(INTERVAL_S)

    def close(self) -> None:
        """Stops sampling, after one last sample (of what is left of the tree)."""
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, tree_rss_bytes(self.root))

    def __enter__(self) -> TreePeak:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
