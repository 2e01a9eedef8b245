"""How each run key shows in ``kvtb run --help``: the section it is listed in
(:data:`SECTIONS`) and, for a key whose values are a closed set, that set (:func:`choices`),
read from the table that defines it (engines, routers, policies, ...), never restated.

The help line itself is the field's docstring (:func:`testbed.core.typed_values.help_line`),
so that what a key means is written once, under the field in :mod:`testbed.spec.runspec`."""

from __future__ import annotations

import typing

SECTIONS: dict[str, tuple[str, ...]] = {
    "workload": (
        "workload", "requests", "seed", "workload_params", "arrival", "max_output_tokens",
    ),
    "engine": (
        "engine", "model", "profile", "mla", "tp", "engine_blocks", "block_size",
        "max_num_batched_tokens", "max_num_seqs", "prefix_caching", "time_profile",
        "time_model", "endpoint", "endpoints", "launch",
    ),
    "cache": (
        "chunk_size", "capacity_tokens", "capacity_bytes", "policy", "load_async",
        "transfer_mode", "store_wait", "metadata_only", "pool_medium", "fault_drop_fraction",
        "server_timeout_s", "server", "token_file", "tiers", "tier_write", "tier_promote",
        "prefetch", "lookup_mirror",
    ),
    "fleet": ("instances", "router", "router_params", "servers"),
    "tracing": ("trace_sampler", "trace_sampler_ratio", "otlp_endpoint", "otlp_protocol"),
}  # fmt: skip
"""``kvtb run --help``'s sections: the run keys (and the command's own flags, by their
``dest``) listed in each; a key in none is listed with the main flags."""


def section(name: str) -> str | None:
    """The section a run key or flag ``dest`` is listed in (``None``: the main flags)."""
    return next((title for title, names in SECTIONS.items() if name in names), None)


def choices(name: str) -> tuple[str, ...] | None:
    """The values run key ``name`` may take, where they are a closed set (else ``None``)."""
    from server.tiers.policies import PROMOTE_POLICIES
    from testbed.core.policies import POLICIES
    from testbed.core.protocol import POOL_MEDIA
    from testbed.core.telemetry.sampling import SAMPLERS
    from testbed.fleet.routers import ROUTERS
    from testbed.models.hardware import HARDWARE
    from testbed.models.profiles import PROFILES
    from testbed.models.time_model import FLAT
    from testbed.spec import runspec
    from testbed.spec.engines import ENGINE_NAMES, ORACLE_POLICIES

    sets: dict[str, tuple[str, ...]] = {
        "engine": ENGINE_NAMES,
        "profile": tuple(PROFILES),
        "policy": tuple(sorted({*POLICIES, *ORACLE_POLICIES})),
        "transfer_mode": typing.get_args(runspec.TransferMode),
        "arrival": typing.get_args(runspec.Arrival),
        "pool_medium": tuple(POOL_MEDIA),
        "time_profile": (FLAT, *HARDWARE),
        "time_model": tuple(n for n, prof in PROFILES.items() if prof.has_compute_shape),
        "trace_sampler": SAMPLERS,
        "router": tuple(ROUTERS),
        "servers": typing.get_args(runspec.FleetServers),
        "tier_promote": PROMOTE_POLICIES,
    }
    return sets.get(name)
