"""A what-if's results, and their files: ``whatif.json`` plus Parquet tables.

``DIR/whatif.json``::

    {"schema": 1,
     "source": {"kind": "workload" | "run", ...}, "profile": ..., "stored_bytes_per_token": ...,
     "num_requests": ..., "prompt_tokens": ..., "chunk_sizes": [...], "policies": [...],
     "sample_rate": 1.0, "sampling": null | {"estimated_max_error": {chunk: e}, ...},
     "curves": {"<chunk size>": {"<policy>": [
         {"capacity_tokens": int | null, "token_hit_rate": ..., "mean_request_hit_rate": ...,
          "hit_tokens": ..., "external_hit_tokens": ..., "exact": bool}, ...]}},
     "min_capacity": {"<chunk size>": [{"fraction": 0.9, "capacity_tokens": ...,
                                         "capacity_bytes": ..., "token_hit_rate": ...}, ...]},
     "reuse": [{"chunk_size", "group", "count", "distance_bytes_p50", ..., "interval_s_p99"}],
     "run": null | {"capacity_tokens", "measured_external_hit_tokens",
                    "predicted_external_hit_tokens", "residual_fraction_of_prompt_tokens", ...},
     "tables": {"lru_curves": "lru_curves.parquet", "reuse": "reuse.parquet", ...}}

``capacity_tokens: null`` is the unlimited cache. ``lru_curves.parquet`` holds every step of
each exact LRU curve; ``reuse.parquet`` the reuse distance and interval quantiles per group;
``run_requests.parquet`` (run sources) the measured and predicted external hits per request;
``tiers.parquet`` (``--tiers``) hit tokens per tier at every (L1, L2) capacity pair and tier
policy, each row's ``method`` saying ``one_pass`` or ``simulated`` (:mod:`.tiers`).
:func:`load_whatif` reads it all back in one call.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

SCHEMA = 1
WHATIF_JSON = "whatif.json"
TABLES = {
    "lru_curves": "lru_curves.parquet",
    "reuse": "reuse.parquet",
    "run_requests": "run_requests.parquet",
    "tiers": "tiers.parquet",
}
POINT_FIELDS = (
    "capacity_tokens",
    "token_hit_rate",
    "mean_request_hit_rate",
    "hit_tokens",
    "external_hit_tokens",
    "exact",
)


@dataclass(frozen=True, eq=False)
class WhatIf:
    """Everything a what-if computed (or loaded from its directory)."""

    meta: dict[str, Any]
    """``whatif.json`` without its curves, gauges and table names."""
    points: pd.DataFrame
    """``chunk_size, policy`` and :data:`POINT_FIELDS` (``capacity_tokens`` nullable)."""
    curves: pd.DataFrame
    """Every step of every LRU curve: ``chunk_size, capacity_tokens, hit_tokens,
    token_hit_rate, mean_request_hit_rate``."""
    min_capacity: pd.DataFrame
    """``chunk_size, fraction, capacity_tokens, capacity_bytes, token_hit_rate``."""
    reuse: pd.DataFrame
    """Reuse distance / interval quantiles: see :func:`.reuse.reuse_quantiles`."""
    run_requests: pd.DataFrame | None = None
    """Run sources: per request, measured and predicted external hit tokens."""
    tiers: pd.DataFrame | None = None
    """A what-if over tiers: :func:`.tiers.tier_table`'s rows for every chunk size."""
    lru: dict[int, Any] = field(default_factory=dict)
    """In memory only: the :class:`~.curves.LRUCurve` per chunk size (empty when loaded)."""

    def curve(self, chunk_size: int, policy: str = "lru") -> pd.DataFrame:
        """The points of one chunk size and policy, by capacity (unlimited last)."""
        chosen = self.points[
            (self.points["chunk_size"] == chunk_size) & (self.points["policy"] == policy)
        ]
        if chosen.empty:
            raise KeyError(f"no {policy} points at chunk size {chunk_size}")
        return chosen.sort_values("capacity_tokens", na_position="last").reset_index(drop=True)

    def point(self, chunk_size: int, capacity_tokens: int | None, policy: str = "lru") -> dict:
        """The point at one capacity (it must be among the points)."""
        curve = self.curve(chunk_size, policy)
        column = curve["capacity_tokens"]
        chosen = (
            curve[column.isna()] if capacity_tokens is None else curve[column == capacity_tokens]
        )
        if chosen.empty:
            raise KeyError(f"no {policy} point at {capacity_tokens} tokens, chunk {chunk_size}")
        return {k: _plain(v) for k, v in chosen.iloc[0].to_dict().items()}


def write_whatif(whatif: WhatIf, out_dir: Path | str) -> Path:
    """Writes ``whatif.json`` and the Parquet tables into ``out_dir``; returns the JSON path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tables = {"lru_curves": whatif.curves, "reuse": whatif.reuse}
    if whatif.run_requests is not None:
        tables["run_requests"] = whatif.run_requests
    if whatif.tiers is not None:
        tables["tiers"] = whatif.tiers
    for name, frame in tables.items():
        frame.to_parquet(out / TABLES[name], index=False)
    document = {
        "schema": SCHEMA,
        **whatif.meta,
        "curves": _nested_points(whatif.points),
        "min_capacity": {
            str(size): [
                {k: _plain(v) for k, v in row.items() if k != "chunk_size"}
                for row in frame.to_dict("records")
            ]
            for size, frame in whatif.min_capacity.groupby("chunk_size")
        },
        "tables": {name: TABLES[name] for name in tables},
    }
    path = out / WHATIF_JSON
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(document, indent=1, default=_plain) + "\n")
    tmp.replace(path)
    return path


def load_whatif(out_dir: Path | str) -> WhatIf:
    """A what-if directory written by :func:`write_whatif` (or ``kvtb whatif``)."""
    out = Path(out_dir)
    path = out / WHATIF_JSON
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: run `kvtb whatif ... --out {out}` first")
    document = json.loads(path.read_text())
    if document.get("schema") != SCHEMA:
        raise ValueError(f"{path}: schema {document.get('schema')!r}, expected {SCHEMA}")
    rows = [
        {"chunk_size": int(size), "policy": policy, **point}
        for size, policies in document.pop("curves").items()
        for policy, points in policies.items()
        for point in points
    ]
    points = pd.DataFrame(rows, columns=["chunk_size", "policy", *POINT_FIELDS])
    points["capacity_tokens"] = points["capacity_tokens"].astype("Int64")
    gauges = pd.DataFrame(
        [
            {"chunk_size": int(size), **row}
            for size, entries in document.pop("min_capacity").items()
            for row in entries
        ]
    )
    tables = document.pop("tables")
    frames = {name: pd.read_parquet(out / file) for name, file in tables.items()}
    return WhatIf(
        meta=document,
        points=points,
        curves=frames["lru_curves"],
        min_capacity=gauges,
        reuse=frames["reuse"],
        run_requests=frames.get("run_requests"),
        tiers=frames.get("tiers"),
    )


def _nested_points(points: pd.DataFrame) -> dict[str, dict[str, list[dict[str, Any]]]]:
    nested: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for row in points.to_dict("records"):
        entry = {k: _plain(row[k]) for k in POINT_FIELDS}
        nested.setdefault(str(row["chunk_size"]), {}).setdefault(row["policy"], []).append(entry)
    for policies in nested.values():
        for entries in policies.values():
            entries.sort(
                key=lambda p: math.inf if p["capacity_tokens"] is None else p["capacity_tokens"]
            )
    return nested


def _plain(value: Any) -> Any:
    """numpy / pandas scalars as JSON values (NaN and NA as null)."""
    if value is None or value is pd.NA:
        return None
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
