"""Sessions: hit rates per conversation and per agent, their distribution, by turn, context
growth and sub-agent reuse (METRICS.md, "Sessions").

Reads the per-request table (:attr:`testbed.analysis.tables.Run.requests`). A request's
``group`` is its conversation, or for a sub-agent of an agentic workload ``CONVERSATION/AGENT``
(:data:`~testbed.workloads.agentic_format.GROUP_SEPARATOR`); its *turn* is its position among
its group's requests by arrival. Hit tokens are ``E + X`` (the oracle's: its matched chunks).

:func:`trace_reuse` is the other figure: what a block-hash trace itself reuses between
consecutive requests, the quantity kv-cache-tester publishes (:data:`PUBLISHED`), computed from
the block ids without a run.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from testbed.analysis.per_request import NO_GROUP
from testbed.analysis.source import Source
from testbed.analysis.tables import Run
from testbed.workloads import BlockRequest, BlockTraceWorkload, make_workload
from testbed.workloads.agentic_format import GROUP_SEPARATOR

PUBLISHED = pd.Series(
    {"groups": 739, "min": 0.61, "p25": 0.92, "median": 0.96, "p75": 0.97, "max": 1.00,
     "mean": 0.93},
    name="published: consecutive-request reuse (kv-cache-tester, 739 traces)",
)  # fmt: skip
"""kv-cache-tester's published distribution: per conversation, the share of blocks matching
the previous request's."""
STATISTICS = ("groups", "min", "p25", "median", "p75", "max", "mean")


def session_run(source: Source) -> Run:
    """The run whose sessions a notebook shows: the first measured run, else the first run
    (an oracle run's per-request table holds its hits too)."""
    measured = source.first_measured()
    return measured if measured is not None else source.run(str(source.runs["run_id"].iloc[0]))


def turns(requests: pd.DataFrame) -> pd.DataFrame:
    """One row per request: ``request_id``, ``group``, ``conversation``, ``agent`` (``""`` for
    the conversation's own requests), ``turn`` (0-based, by arrival within the group),
    ``arrival_s``, ``prompt_tokens``, ``hit_tokens`` (E + X) and ``hit_share`` (hit / prompt)."""
    group = _groups(requests)
    split = group.str.partition(GROUP_SEPARATOR)
    table = pd.DataFrame(
        {
            "request_id": requests["request_id"].astype(str).to_numpy(),
            "group": group.to_numpy(),
            "conversation": split[0].to_numpy(),
            "agent": split[2].to_numpy(),
            "arrival_s": pd.to_numeric(requests["arrival_s"], errors="coerce").to_numpy(),
            "prompt_tokens": requests["prompt_tokens"].astype("int64").to_numpy(),
            "hit_tokens": (requests["engine_hit_tokens"] + requests["external_hit_tokens"])
            .astype("int64")
            .to_numpy(),
        }
    )
    table["hit_share"] = table["hit_tokens"] / table["prompt_tokens"].clip(lower=1)
    order = table.sort_values(["group", "arrival_s"], kind="stable")
    table["turn"] = order.groupby("group", sort=False).cumcount().reindex(table.index)
    return table


def group_hit_rates(requests: pd.DataFrame, level: str = "conversation") -> pd.DataFrame:
    """Per conversation (``level="conversation"``: its sub-agents included) or per group
    (``"group"``: each agent apart): ``requests``, ``prompt_tokens``, ``hit_tokens``,
    ``token_hit_rate`` (Σ hit / Σ prompt) and ``mean_request_hit_rate``; by first arrival."""
    if level not in ("conversation", "group"):
        raise ValueError(f"level must be 'conversation' or 'group', got {level!r}")
    table = turns(requests)
    grouped = table.groupby(level, sort=False)
    rates = pd.DataFrame(
        {
            "requests": grouped.size(),
            "first_arrival_s": grouped["arrival_s"].min(),
            "prompt_tokens": grouped["prompt_tokens"].sum(),
            "hit_tokens": grouped["hit_tokens"].sum(),
            "mean_request_hit_rate": grouped["hit_share"].mean(),
        }
    )
    rates.insert(4, "token_hit_rate", rates["hit_tokens"] / rates["prompt_tokens"].clip(lower=1))
    return rates.sort_values("first_arrival_s", kind="stable").rename_axis(level).reset_index()


def distribution(rates: pd.Series, name: str) -> pd.Series:
    """``groups`` and min, P25, median, P75, max and mean of ``rates`` (one per group)."""
    values = pd.to_numeric(rates, errors="coerce").dropna().to_numpy(dtype=float)
    if not len(values):
        return pd.Series({"groups": 0}, name=name).reindex(list(STATISTICS))
    low, p25, median, p75, high = np.quantile(values, [0, 0.25, 0.5, 0.75, 1])
    figures = [len(values), low, p25, median, p75, high, values.mean()]
    return pd.Series(dict(zip(STATISTICS, figures, strict=True)), name=name)


def distribution_table(requests: pd.DataFrame, reuse: pd.DataFrame | None = None) -> pd.DataFrame:
    """The per-conversation and per-agent token hit rates' distributions, beside the trace's
    own consecutive-request reuse (``reuse``: :func:`trace_reuse`) and :data:`PUBLISHED`."""
    per_conversation = group_hit_rates(requests)["token_hit_rate"]
    per_agent = group_hit_rates(requests, "group")["token_hit_rate"]
    rows = [
        distribution(per_conversation, "token hit rate per conversation"),
        distribution(per_agent, "token hit rate per agent"),
    ]
    if reuse is not None and len(reuse):
        rows.append(distribution(reuse["reuse"], "the trace: consecutive-request reuse"))
    rows.append(PUBLISHED)
    table = pd.DataFrame(rows)
    table["groups"] = table["groups"].astype("Int64")
    return table


def hit_rate_by_turn(requests: pd.DataFrame, max_turns: int = 50) -> pd.DataFrame:
    """Per turn index (up to ``max_turns``): ``groups`` having that turn, ``prompt_tokens``
    (mean), ``token_hit_rate`` (Σ hit / Σ prompt over the groups' requests at that turn) and
    the P25/median/P75 of their hit shares."""
    table = turns(requests)
    table = table[table["turn"] < max_turns]
    grouped = table.groupby("turn")
    prompt = grouped["prompt_tokens"].sum().clip(lower=1)
    by_turn = pd.DataFrame(
        {
            "groups": grouped.size(),
            "prompt_tokens": grouped["prompt_tokens"].mean(),
            "token_hit_rate": grouped["hit_tokens"].sum() / prompt,
            "hit_share_p25": grouped["hit_share"].quantile(0.25),
            "hit_share_median": grouped["hit_share"].median(),
            "hit_share_p75": grouped["hit_share"].quantile(0.75),
        }
    )
    return by_turn.reset_index()


def subagent_reuse(requests: pd.DataFrame) -> pd.DataFrame:
    """Per sub-agent: ``conversation``, ``agent``, ``requests``, ``prompt_tokens``,
    ``token_hit_rate`` and ``first_hit_share``: the hit share of its first request, which
    only the parent's and the earlier agents' requests can have stored (what a sub-agent
    reuses of theirs). Empty when no request belongs to a sub-agent."""
    table = turns(requests)
    agents = table[table["agent"] != ""]
    columns = ["conversation", "agent", "requests", "prompt_tokens", "token_hit_rate"]
    if agents.empty:
        return pd.DataFrame(columns=[*columns, "first_hit_share"])
    grouped = agents.groupby(["conversation", "agent"], sort=False)
    first = agents[agents["turn"] == 0].set_index(["conversation", "agent"])["hit_share"]
    out = pd.DataFrame(
        {
            "requests": grouped.size(),
            "prompt_tokens": grouped["prompt_tokens"].sum(),
            "token_hit_rate": grouped["hit_tokens"].sum() / grouped["prompt_tokens"].sum(),
            "first_hit_share": first,
        }
    )
    return out.reset_index()


def trace_reuse(run: Run) -> pd.DataFrame | None:
    """Per conversation of the run's block-hash trace: ``requests`` with a predecessor (the
    previous request of the same group), ``blocks`` (their block ids), ``reused_blocks`` (the
    ids each shares as a prefix with its predecessor) and ``reuse`` = reused / blocks.
    ``None`` for a workload that is not a block-hash trace. A relative trace path is taken from
    the working directory, else from the directories above the run (where it was made)."""
    spec = run.spec
    prefix, colon, path = str(spec["workload"]).partition(":")
    if colon and not Path(path).is_absolute() and not Path(path).exists():
        found = next((base / path for base in run.path.parents if (base / path).exists()), None)
        path = str(found or path)
    workload = make_workload(
        f"{prefix}{colon}{path}",
        num_requests=spec.get("requests"),
        seed=int(spec.get("seed", 0)),
        params=spec.get("workload_params") or {},
    )
    if not isinstance(workload, BlockTraceWorkload):
        return None
    return consecutive_reuse(list(workload.block_requests()))


def consecutive_reuse(requests: list[BlockRequest]) -> pd.DataFrame:
    """:func:`trace_reuse` of block requests (in arrival order)."""
    previous: dict[str, np.ndarray] = {}
    rows = []
    for request in requests:
        before = previous.get(request.group)
        previous[request.group] = ids = request.block_ids
        if before is None:
            continue
        length = min(len(before), len(ids))
        differs = np.flatnonzero(before[:length] != ids[:length])
        shared = int(differs[0]) if len(differs) else length
        conversation = request.group.partition(GROUP_SEPARATOR)[0] or NO_GROUP
        rows.append((conversation, len(ids), shared))
    frame = pd.DataFrame(rows, columns=["conversation", "blocks", "reused_blocks"])
    grouped = frame.groupby("conversation", sort=False)
    table = pd.DataFrame({"requests": grouped.size(), **grouped[["blocks", "reused_blocks"]].sum()})
    table["reuse"] = table["reused_blocks"] / table["blocks"].clip(lower=1)
    return table.reset_index()


def _groups(requests: pd.DataFrame) -> pd.Series:
    if "group" not in requests:
        return pd.Series(NO_GROUP, index=requests.index)
    group = requests["group"].astype(object)
    return group.where(group.notna() & (group != ""), NO_GROUP).astype(str)
