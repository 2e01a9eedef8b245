"""Questions asked of the per-request table (:attr:`testbed.analysis.tables.Run.requests`).

The table is a run's ``metrics.parquet``: one row per request, every prompt token in one of
the categories of :mod:`testbed.analysis.attribution`, and the engine's facts (``arrival_s``,
``ttft_ms``). The functions here only read it:

- :func:`hit_shares`: each request's hit share and TTFT, and whether the external cache
  served it;
- :func:`tokens_by_group`: where the tokens of each request group (conversation, document)
  went, the busiest groups and the rest;
- :func:`request_to_explain`: the request whose misses best show what the cache did, for
  :func:`testbed.analysis.explain.explain`; :func:`most_loaded`: the one that loaded the
  most from the cache server.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from testbed.analysis.attribution import CATEGORIES

NO_GROUP = "(no group)"
SERVED_BY = ("external cache", "vLLM prefix cache only", "no hit")
"""What served a request's hits (:func:`hit_shares`): the cache server loaded some of its
tokens; only vLLM's own prefix cache hit; nothing hit."""
EXPLAIN_PREFERENCE = (
    "capacity",
    "load_failed",
    "in_flight",
    "unavailable",
    "refused",
    "engine_only",
    "external",
    "cold",
)
"""The categories :func:`request_to_explain` looks for, most telling first."""


def hit_shares(requests: pd.DataFrame) -> pd.DataFrame:
    """One row per request: ``request_id``, ``group``, ``arrival_s``, ``prompt_tokens``,
    ``hit_share`` ((E + X) / P), ``external_share`` (X / P), ``recomputed_tokens``,
    ``ttft_ms`` (NaN where the engine measured none) and ``served_by`` (:data:`SERVED_BY`)."""
    prompt = requests["prompt_tokens"].astype(float).clip(lower=1)
    engine = requests["engine_hit_tokens"].astype(float)
    external = requests["external_hit_tokens"].astype(float)
    served = np.select([external > 0, engine > 0], list(SERVED_BY[:2]), default=SERVED_BY[2])
    return pd.DataFrame(
        {
            "request_id": requests["request_id"].astype(str),
            "group": _groups(requests),
            "arrival_s": _column(requests, "arrival_s"),
            "prompt_tokens": requests["prompt_tokens"].astype("int64"),
            "hit_share": (engine + external) / prompt,
            "external_share": external / prompt,
            "recomputed_tokens": requests["recomputed_tokens"].astype("int64"),
            "ttft_ms": _column(requests, "ttft_ms"),
            "served_by": pd.Categorical(served, categories=SERVED_BY),
        }
    ).reset_index(drop=True)


def tokens_by_group(requests: pd.DataFrame, top: int = 12) -> pd.DataFrame:
    """Per request group: ``label`` (the group), ``requests``, ``first_arrival_s`` and the sum
    of every category of :data:`~testbed.analysis.attribution.CATEGORIES`. The ``top`` groups
    with the most prompt tokens, in order of their first request, then one row ``other (N
    groups)`` for the rest when there is a rest."""
    frame = requests.assign(
        _group=_groups(requests).to_numpy(), _arrival=_column(requests, "arrival_s").to_numpy()
    )
    grouped = frame.groupby("_group", sort=False)
    table = grouped[list(CATEGORIES)].sum()
    table.insert(0, "requests", grouped.size())
    table.insert(1, "first_arrival_s", grouped["_arrival"].min())
    table["_prompt"] = table[list(CATEGORIES)].sum(axis=1)
    busiest = table.nlargest(top, "_prompt", keep="first").sort_values(
        "first_arrival_s", kind="stable"
    )
    rest = table.drop(index=busiest.index)
    if len(rest):
        other = rest[["requests", *CATEGORIES]].sum()
        other["first_arrival_s"] = rest["first_arrival_s"].min()
        busiest.loc[f"other ({len(rest)} groups)"] = other
    out = busiest.drop(columns="_prompt").rename_axis("label").reset_index()
    out["requests"] = out["requests"].astype("int64")
    return out


def request_to_explain(requests: pd.DataFrame) -> str | None:
    """The ``request_id`` of the request to explain: the one with the most tokens in the
    first category of :data:`EXPLAIN_PREFERENCE` that any request has (a capacity miss tells
    more than a cold one; a request the cache served more than one it never saw); the first
    such request on ties. ``None`` for an empty table."""
    if requests.empty:
        return None
    for category in EXPLAIN_PREFERENCE:
        if category not in requests:
            continue
        tokens = requests[category].fillna(0).to_numpy()
        if tokens.max(initial=0) > 0:
            return str(requests["request_id"].iloc[int(np.argmax(tokens))])
    return str(requests["request_id"].iloc[0])


def most_loaded(requests: pd.DataFrame) -> pd.Series:
    """The request that loaded the most from the external cache (the most hit tokens when
    none loaded anything; the first on ties): its row of the per-request table."""
    if requests.empty:
        raise ValueError("the run has no requests")
    loaded = requests["external_hit_tokens"].to_numpy()
    if loaded.max(initial=0) <= 0:
        loaded = (requests["engine_hit_tokens"] + requests["external_hit_tokens"]).to_numpy()
    return requests.iloc[int(np.argmax(loaded))]


def _groups(requests: pd.DataFrame) -> pd.Series:
    if "group" not in requests:
        return pd.Series(NO_GROUP, index=requests.index)
    return requests["group"].astype(object).where(requests["group"].notna(), NO_GROUP).astype(str)


def _column(requests: pd.DataFrame, name: str) -> pd.Series:
    if name not in requests:
        return pd.Series(np.nan, index=requests.index)
    return pd.to_numeric(requests[name], errors="coerce").astype(float)
