"""The sentence a sweep's report opens with: where the prompt tokens of its headline run went.

The headline run is the measured run (an engine in front of the cache server) that shows what
the external cache can buy: of the first workload's runs, the one with the largest capacity
(unlimited first). The sentence gives its shares of the prompt tokens: vLLM's own prefix cache,
the external cache, recomputed, and the largest causes of the misses (METRICS.md).
"""

from __future__ import annotations

import pandas as pd

from testbed.analysis.attribution import MISS_CAUSES

_CAUSES_SHOWN = 3


def headline_run(runs: pd.DataFrame) -> pd.Series | None:
    """The headline run's row of ``runs`` (a sweep's index or a source's runs); ``None``
    without a measured run that has token figures."""
    measured = runs[(runs["engine"] != "oracle") & runs["prompt_tokens"].notna()]
    if measured.empty:
        return None
    first = measured[measured["workload"] == measured["workload"].iloc[0]]
    if "capacity_tokens" not in first:
        return first.iloc[0]
    capacity = pd.to_numeric(first["capacity_tokens"], errors="coerce").astype(float)
    return first.iloc[int(capacity.fillna(float("inf")).to_numpy().argmax())]


def headline(runs: pd.DataFrame, label: str = "label") -> str | None:
    """One sentence on the headline run (``None`` without one)."""
    row = headline_run(runs)
    if row is None:
        return None
    prompt = float(row["prompt_tokens"])
    share = {name: float(row[f"{name}_hit_tokens"]) / prompt for name in ("engine", "external")}
    misses = {name: float(row.get(f"tokens_{name}", 0) or 0) / prompt for name in MISS_CAUSES}
    largest = sorted(misses.items(), key=lambda item: -item[1])[:_CAUSES_SHOWN]
    causes = ", ".join(f"{name} {value:.0%}" for name, value in largest if value >= 0.005)
    recomputed = 1.0 - share["engine"] - share["external"]
    return (
        f"In run `{row['run_id']}` ({row[label]}), the external cache served "
        f"{share['external']:.0%} of the prompt tokens and vLLM's own prefix cache "
        f"{share['engine']:.0%}; {recomputed:.0%} were computed"
        + (f" (largest causes: {causes})." if causes else ".")
    )
