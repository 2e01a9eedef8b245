"""Measured figures for a hardware profile: fits of prefill and KV-load times taken on a GPU.

Pure arithmetic (numpy), run wherever the measurements are read. The device run
(``testbed.bench.gpu_data_path``, from ``scripts/gpu_check.sh``) times the prefill of a model with
a profile's compute shape at a few prompt lengths, and the load of the same tokens' KV from
the cache server's pools; :func:`calibrate` turns those points into the ``measured_*`` fields
of :class:`testbed.models.hardware.Hardware`:

- ``measured_compute_efficiency``: the least-squares rate ``R`` of ``t_i ≈ F_i / R`` over the
  prefills (``F_i``: the time model's FLOPs of prompt ``i`` alone), as a share of the peak;
- ``measured_load_bytes_per_s`` and ``measured_load_latency_s``: the line ``t ≈ latency +
  bytes / rate`` through the loads (the latency clipped at 0; one point: latency 0).

:func:`calibration_toml` writes them as a ``load_hardware`` table, so a run's file can be
loaded as it is (``--hardware-file``) or its values copied into ``HARDWARE``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from testbed.models.hardware import Hardware
from testbed.models.profiles import KVProfile
from testbed.models.time_model import RooflineTimeModel

Point = tuple[int, float]
"""``(tokens, milliseconds)``."""


def fit_compute_efficiency(
    hardware: Hardware, profile: KVProfile, prefill_ms: Sequence[Point]
) -> float:
    """The share of ``peak_flops`` that explains the measured prefill times best."""
    if not prefill_ms:
        raise ValueError("no prefill measurements to fit")
    model = RooflineTimeModel(hardware, profile)
    flops = np.array([model.flops(np.array([n]), np.array([0])) for n, _ in prefill_ms])
    seconds = np.array([ms / 1e3 for _, ms in prefill_ms])
    if np.any(seconds <= 0):
        raise ValueError("prefill times must be positive")
    rate = float(np.sum(flops * flops) / np.sum(flops * seconds))
    return min(1.0, rate / hardware.peak_flops)


def fit_load(bytes_per_token: int, load_ms: Sequence[Point]) -> tuple[float, float]:
    """``(bytes per second, latency seconds)`` of the line through the measured loads."""
    if not load_ms:
        raise ValueError("no load measurements to fit")
    nbytes = np.array([n * bytes_per_token for n, _ in load_ms], dtype=np.float64)
    seconds = np.array([ms / 1e3 for _, ms in load_ms])
    if len(load_ms) == 1 or np.ptp(nbytes) == 0:
        return float(nbytes.mean() / seconds.mean()), 0.0
    slope, intercept = np.polyfit(nbytes, seconds, 1)
    if slope <= 0:
        raise ValueError("load times do not grow with the bytes loaded: cannot fit a rate")
    if intercept < 0:  # a line through the origin instead
        return float(np.sum(nbytes * nbytes) / np.sum(nbytes * seconds)), 0.0
    return float(1.0 / slope), float(intercept)


def calibrate(
    hardware: Hardware,
    profile: KVProfile,
    prefill_ms: Sequence[Point],
    load_ms: Sequence[Point],
    source: str,
) -> Hardware:
    """``hardware`` with its ``measured_*`` figures fitted to the points."""
    rate, latency = fit_load(profile.bytes_per_token(), load_ms)
    return replace(
        hardware,
        measured_compute_efficiency=fit_compute_efficiency(hardware, profile, prefill_ms),
        measured_load_bytes_per_s=rate,
        measured_load_latency_s=latency,
        measured_prefill_ms=tuple((int(n), float(ms)) for n, ms in prefill_ms),
        measured_load_ms=tuple((int(n), float(ms)) for n, ms in load_ms),
        measured_source=source,
    )


def calibration_toml(hardware: Hardware) -> str:
    """The measured fields as a ``[name]`` table that ``load_hardware`` reads."""

    def points(values: tuple[tuple[int, float], ...] | None) -> str:
        return "[" + ", ".join(f"[{n}, {ms:.4f}]" for n, ms in values or ()) + "]"

    return "\n".join(
        [
            f"[{hardware.name}]",
            f"measured_compute_efficiency = {hardware.measured_compute_efficiency!r}",
            f"measured_load_bytes_per_s = {hardware.measured_load_bytes_per_s!r}",
            f"measured_load_latency_s = {hardware.measured_load_latency_s!r}",
            f"measured_prefill_ms = {points(hardware.measured_prefill_ms)}",
            f"measured_load_ms = {points(hardware.measured_load_ms)}",
            f"measured_source = {json.dumps(hardware.measured_source)}",
            "",
        ]
    )
