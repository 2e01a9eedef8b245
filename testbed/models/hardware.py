"""Hardware profiles: an accelerator's published figures and the time model's assumptions.

:data:`HARDWARE` names the built-in profiles (H100, H200, A100, L40S). Figures are from the
vendors' datasheets (dense bf16 tensor FLOP/s, i.e. half the "with sparsity" number; HBM
bandwidth; host link per direction, half the bidirectional PCIe figure). The efficiency factors
and fixed costs are assumptions until a GPU run calibrates them: a profile's ``measured_*``
figures (fitted by :mod:`testbed.models.calibration` from prefill and KV-load times measured on
the device, ``scripts/gpu_check.sh``) replace the compute efficiency, the load rate and the
load latency when present (:meth:`Hardware.datasheet` gives the profile without them). Add or
override profiles in a TOML file (:func:`load_hardware`). The roofline that uses them is
:mod:`testbed.models.time_model`.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path


@dataclass(frozen=True)
class Hardware:
    """One accelerator's published figures and the model's assumptions about them."""

    name: str
    peak_flops: float
    """Dense bf16 tensor FLOP/s (datasheet)."""
    hbm_bytes_per_s: float
    """Device memory bandwidth (datasheet)."""
    link_bytes_per_s: float
    """Host-device link, one direction (datasheet; half the bidirectional figure)."""
    compute_efficiency: float = 0.5
    """Share of ``peak_flops`` prefill reaches (model FLOPs utilisation; an assumption)."""
    memory_efficiency: float = 0.8
    link_efficiency: float = 0.8
    step_overhead_s: float = 0.0
    """Fixed cost of a step (launches, scheduling)."""
    load_latency_s: float = 0.0
    """Fixed cost of one request's load (lookup and retrieve round trip)."""
    chunk_overhead_s: float = 0.0
    """Fixed cost per chunk loaded (per-object transfer setup)."""
    overlap_loads: bool = False
    """Whether loads overlap the forward pass (layer-wise pipelining) instead of preceding it."""
    source: str = ""
    """Where the figures come from."""
    measured_compute_efficiency: float | None = None
    """Share of ``peak_flops`` a prefill reached on this hardware, fitted to measured prefill
    times (``testbed.models.calibration``); replaces ``compute_efficiency`` when given."""
    measured_load_bytes_per_s: float | None = None
    """KV load rate measured from the cache server's default pool (pinned host memory) into
    the GPU; replaces ``link_bytes_per_s × link_efficiency`` when given."""
    measured_load_latency_s: float | None = None
    """Fixed cost of one load, fitted with the rate; replaces ``load_latency_s`` when given."""
    measured_prefill_ms: tuple[tuple[int, float], ...] | None = None
    """The measured points ``(prompt tokens, prefill ms)`` the fit came from (the record)."""
    measured_load_ms: tuple[tuple[int, float], ...] | None = None
    """The measured points ``(tokens, load ms)`` the load fit came from."""
    measured_source: str = ""
    """Where, when and with what command the measured figures were taken."""

    def __post_init__(self) -> None:
        problems = [
            f"{f} must be positive"
            for f in ("peak_flops", "hbm_bytes_per_s", "link_bytes_per_s")
            if not getattr(self, f) > 0
        ]
        problems += [
            f"{f} must be in (0, 1]"
            for f in ("compute_efficiency", "memory_efficiency", "link_efficiency")
            if not 0 < getattr(self, f) <= 1
        ]
        problems += [
            f"{f} must be >= 0"
            for f in ("step_overhead_s", "load_latency_s", "chunk_overhead_s")
            if not getattr(self, f) >= 0
        ]
        if self.measured_compute_efficiency is not None and not (
            0 < self.measured_compute_efficiency <= 1
        ):
            problems.append("measured_compute_efficiency must be in (0, 1]")
        if self.measured_load_bytes_per_s is not None and not self.measured_load_bytes_per_s > 0:
            problems.append("measured_load_bytes_per_s must be positive")
        if problems:
            raise ValueError(f"hardware profile {self.name!r}: " + "; ".join(problems))

    @property
    def measured(self) -> bool:
        """Whether measured figures replace the datasheet's assumptions."""
        return self.measured_compute_efficiency is not None or (
            self.measured_load_bytes_per_s is not None
        )

    @property
    def effective_compute_efficiency(self) -> float:
        return self.measured_compute_efficiency or self.compute_efficiency

    @property
    def effective_load_bytes_per_s(self) -> float:
        """KV load rate: measured, else the datasheet link at ``link_efficiency``."""
        return self.measured_load_bytes_per_s or self.link_bytes_per_s * self.link_efficiency

    @property
    def effective_load_latency_s(self) -> float:
        if self.measured_load_latency_s is None:
            return self.load_latency_s
        return self.measured_load_latency_s

    def datasheet(self) -> Hardware:
        """This profile without its measured figures (to compare both bases)."""
        return replace(
            self,
            measured_compute_efficiency=None,
            measured_load_bytes_per_s=None,
            measured_load_latency_s=None,
        )


_GB = 1e9
HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        Hardware(
            "h100",
            peak_flops=989.4e12,
            hbm_bytes_per_s=3350 * _GB,
            link_bytes_per_s=64 * _GB,
            source="NVIDIA H100 SXM5 datasheet: 1,979 TFLOPS bf16 with sparsity, HBM3 3.35 TB/s, "
            "PCIe Gen5 128 GB/s (bidirectional)",
        ),
        Hardware(
            "h200",
            peak_flops=989.4e12,
            hbm_bytes_per_s=4800 * _GB,
            link_bytes_per_s=64 * _GB,
            source="NVIDIA H200 SXM datasheet: 1,979 TFLOPS bf16 with sparsity, HBM3e 4.8 TB/s, "
            "PCIe Gen5 128 GB/s (bidirectional)",
            # Measured figures: None until a device run fills them (docs/gpu.md: `bash
            # scripts/gpu_check.sh` writes h200_calibration.toml; copy its values here).
            measured_compute_efficiency=None,
            measured_load_bytes_per_s=None,
            measured_load_latency_s=None,
            measured_prefill_ms=None,
            measured_load_ms=None,
        ),
        Hardware(
            "a100",
            peak_flops=312e12,
            hbm_bytes_per_s=2039 * _GB,
            link_bytes_per_s=32 * _GB,
            source="NVIDIA A100 80GB SXM datasheet: 312 TFLOPS bf16 dense, HBM2e 2,039 GB/s, "
            "PCIe Gen4 64 GB/s (bidirectional)",
        ),
        Hardware(
            "l40s",
            peak_flops=362.05e12,
            hbm_bytes_per_s=864 * _GB,
            link_bytes_per_s=32 * _GB,
            source="NVIDIA L40S datasheet: 362.05 TFLOPS bf16 dense (733 with sparsity), GDDR6 "
            "864 GB/s, PCIe Gen4 x16 64 GB/s (bidirectional)",
        ),
    )
}
"""Named hardware profiles (extend with :func:`load_hardware`)."""


def load_hardware(path: Path | str) -> dict[str, Hardware]:
    """:data:`HARDWARE` extended (or overridden) by a TOML file of tables, one per profile::

        [b200]
        peak_flops = 2.25e15
        hbm_bytes_per_s = 8e12
        link_bytes_per_s = 64e9
        compute_efficiency = 0.55

    A table named like a built-in profile overrides only the keys it gives.
    """
    document = tomllib.loads(Path(path).read_text())
    known = {f.name for f in fields(Hardware)} - {"name"}
    table = dict(HARDWARE)
    for name, values in document.items():
        if not isinstance(values, dict):
            raise ValueError(f"{path}: [{name}] must be a table of hardware figures")
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"{path}: [{name}] has unknown keys {unknown}; valid keys: {sorted(known)}"
            )
        base = table.get(name)
        merged = {**({f.name: getattr(base, f.name) for f in fields(Hardware)} if base else {})}
        merged.update(values, name=name)
        for key in ("measured_prefill_ms", "measured_load_ms"):
            if merged.get(key) is not None:
                merged[key] = tuple(tuple(point) for point in merged[key])
        try:
            table[name] = Hardware(**merged)
        except TypeError as exc:
            raise ValueError(f"{path}: [{name}]: {exc}") from None
    return table
