"""Questions of the per-request table: hit shares, groups, the request to explain."""

from __future__ import annotations

import pandas as pd

from testbed.analysis import per_request as pr
from testbed.analysis.attribution import CATEGORIES


def requests_table(rows: list[dict]) -> pd.DataFrame:
    """A per-request table (metrics.parquet's columns) from partial rows: categories not
    given are 0, E and X are the engine and external categories, the rest recomputed."""
    table = []
    for index, row in enumerate(rows):
        tokens = {name: int(row.get(name, 0)) for name in CATEGORIES}
        prompt = sum(tokens.values())
        table.append(
            {
                "request_id": row.get("request_id", f"r{index}"),
                "group": row.get("group", "g"),
                "arrival_s": float(row.get("arrival_s", index)),
                "prompt_tokens": prompt,
                "engine_hit_tokens": tokens["engine"],
                "external_hit_tokens": tokens["external"],
                "recomputed_tokens": prompt - tokens["engine"] - tokens["external"],
                "ttft_ms": row.get("ttft_ms", 10.0),
                **tokens,
            }
        )
    return pd.DataFrame(table)


def test_hit_shares_say_what_served_each_request():
    table = requests_table(
        [
            {"engine": 30, "external": 50, "cold": 19, "last_token": 1},
            {"engine": 60, "cold": 39, "last_token": 1},
            {"cold": 99, "last_token": 1, "ttft_ms": None},
        ]
    )
    shares = pr.hit_shares(table)
    assert list(shares["served_by"]) == ["external cache", "vLLM prefix cache only", "no hit"]
    assert list(shares["hit_share"]) == [0.8, 0.6, 0.0]
    assert list(shares["external_share"]) == [0.5, 0.0, 0.0]
    assert shares["ttft_ms"].isna().tolist() == [False, False, True]


def test_tokens_by_group_keeps_the_busiest_groups_in_arrival_order_and_sums_the_rest():
    table = requests_table(
        [
            {"group": "late-big", "arrival_s": 5, "cold": 500},
            {"group": "early", "arrival_s": 1, "engine": 100, "cold": 50},
            {"group": "small", "arrival_s": 2, "cold": 10},
            {"group": "tiny", "arrival_s": 3, "cold": 5},
            {"group": "early", "arrival_s": 4, "external": 60, "capacity": 40},
            {"group": None, "arrival_s": 6, "cold": 1},
        ]
    )
    groups = pr.tokens_by_group(table, top=2)
    assert list(groups["label"]) == ["early", "late-big", "other (3 groups)"]
    early = groups.iloc[0]
    assert (early["requests"], early["engine"], early["external"], early["capacity"]) == (
        2,
        100,
        60,
        40,
    )
    other = groups.iloc[2]
    assert (other["requests"], other["cold"], other["first_arrival_s"]) == (3, 16, 2.0)
    assert groups[list(CATEGORIES)].to_numpy().sum() == table["prompt_tokens"].sum()
    everything = pr.tokens_by_group(table, top=10)
    assert pr.NO_GROUP in set(everything["label"]) and len(everything) == 5


def test_the_request_to_explain_has_the_most_telling_miss():
    cold_only = requests_table([{"cold": 10}, {"cold": 30}, {"engine": 5, "cold": 1}])
    assert pr.request_to_explain(cold_only) == "r1"
    table = requests_table([{"cold": 90}, {"capacity": 4, "cold": 1}, {"capacity": 8}])
    assert pr.request_to_explain(table) == "r2"
    assert pr.request_to_explain(table.iloc[0:0]) is None


def test_the_most_loaded_request_loaded_the_most_or_hit_the_most():
    table = requests_table([{"engine": 90, "cold": 1}, {"external": 20, "cold": 5}])
    assert pr.most_loaded(table)["request_id"] == "r1"
    engine_only = requests_table([{"engine": 10, "cold": 1}, {"engine": 90, "cold": 1}])
    assert pr.most_loaded(engine_only)["request_id"] == "r1"


def test_the_engine_spans_table_is_the_engines_record_not_the_per_request_table(tmp_path):
    from testbed.analysis import load_spans, request_spans
    from tests.analysis.synthetic import Prompt, SyntheticRun

    run = SyntheticRun(tmp_path / "run", chunk_size=4)
    run.request("r1", Prompt(("a", "b"), tail=1), group="conversation-1", workload_id="chat-1")
    table = request_spans(load_spans(run.close()))
    assert table[["request_id", "group", "prompt_tokens"]].to_dict("records") == [
        {"request_id": "chat-1", "group": "conversation-1", "prompt_tokens": 9}
    ]
    assert not {"engine_hit_tokens", "external_hit_tokens"} & set(table.columns)
