"""Per-session figures: hit rates per conversation and per agent, by turn, sub-agent reuse,
and the trace's own consecutive-request reuse."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from testbed.analysis import session_plots, sessions
from testbed.workloads import BlockRequest


def table(rows: list[tuple[str, str, float, int, int, int]]) -> pd.DataFrame:
    """Per-request rows: (request id, group, arrival, prompt, engine hits, external hits)."""
    columns = ["request_id", "group", "arrival_s", "prompt_tokens"]
    columns += ["engine_hit_tokens", "external_hit_tokens"]
    return pd.DataFrame(rows, columns=columns)


REQUESTS = table(
    [
        ("a-1", "a", 5.0, 200, 100, 50),  # listed before its group's first request
        ("a-0", "a", 0.0, 100, 0, 0),
        ("a/x-0", "a/x", 2.0, 100, 0, 80),  # a sub-agent reusing the parent's prefix
        ("a/x-1", "a/x", 3.0, 100, 90, 0),
        ("b-0", "b", 1.0, 400, 0, 0),
        ("b-1", "b", 9.0, 400, 200, 200),
    ]
)


def test_a_conversation_counts_its_sub_agents_and_an_agent_only_itself():
    per_conversation = sessions.group_hit_rates(REQUESTS).set_index("conversation")
    assert per_conversation.loc["a", "requests"] == 4
    assert per_conversation.loc["a", "token_hit_rate"] == (150 + 80 + 90) / 500
    assert per_conversation.loc["b", "token_hit_rate"] == 0.5
    per_agent = sessions.group_hit_rates(REQUESTS, "group").set_index("group")
    assert per_agent.loc["a", "token_hit_rate"] == 150 / 300
    assert per_agent.loc["a/x", "mean_request_hit_rate"] == pytest.approx((0.8 + 0.9) / 2)
    with pytest.raises(ValueError, match="level must be"):
        sessions.group_hit_rates(REQUESTS, "agent")


def test_turns_count_by_arrival_within_each_group():
    turns = sessions.turns(REQUESTS).set_index("request_id")
    assert turns["turn"].to_dict() == {
        "a-1": 1,
        "a-0": 0,
        "a/x-0": 0,
        "a/x-1": 1,
        "b-0": 0,
        "b-1": 1,
    }
    assert turns.loc["a/x-1", "conversation"] == "a" and turns.loc["a/x-1", "agent"] == "x"
    by_turn = sessions.hit_rate_by_turn(REQUESTS).set_index("turn")
    assert by_turn.loc[0, "groups"] == 3
    assert by_turn.loc[0, "token_hit_rate"] == 80 / 600
    assert by_turn.loc[1, "token_hit_rate"] == (150 + 90 + 400) / 700


def test_sub_agents_first_requests_show_what_they_reused_of_others():
    reuse = sessions.subagent_reuse(REQUESTS)
    assert reuse[["conversation", "agent", "requests"]].values.tolist() == [["a", "x", 2]]
    assert reuse["first_hit_share"].tolist() == [0.8]
    assert sessions.subagent_reuse(REQUESTS[~REQUESTS["group"].str.contains("/")]).empty


def test_the_distribution_sits_beside_the_published_one():
    shown = sessions.distribution_table(REQUESTS)
    assert shown.loc["token hit rate per conversation", "groups"] == 2
    assert shown.loc["token hit rate per conversation", "max"] == 0.64
    assert shown.loc["token hit rate per conversation", "min"] == 0.5
    assert shown.loc[sessions.PUBLISHED.name, "median"] == 0.96


def _blocks(request_id: str, group: str, ids: list[int]) -> BlockRequest:
    return BlockRequest(request_id, 0.0, group, len(ids) * 64 + 1, 1, np.array(ids), 64, 1, 0)


def test_consecutive_reuse_is_the_prefix_each_request_shares_with_its_groups_previous():
    reuse = sessions.consecutive_reuse(
        [
            _blocks("a-0", "a", [1, 2]),
            _blocks("a/x-0", "a/x", [7, 8, 9]),  # a sub-agent: its own chain
            _blocks("a-1", "a", [1, 2, 3, 4]),  # shares 2 of 4 with a-0
            _blocks("a/x-1", "a/x", [7, 5]),  # shares 1 of 2 with a/x-0
            _blocks("b-0", "b", [1]),
        ]
    ).set_index("conversation")
    assert reuse.loc["a"].to_dict() == {
        "requests": 2,
        "blocks": 6,
        "reused_blocks": 3,
        "reuse": 0.5,
    }
    assert "b" not in reuse.index  # no request with a predecessor


def test_the_figures_draw_each_series():
    figure = session_plots.distribution_figure(REQUESTS, "t")
    assert len(figure.axes[0].lines) == 3  # per conversation, per agent, published
    assert len(session_plots.turn_figure(REQUESTS, "t").axes) == 2
    assert len(session_plots.context_growth_figure(REQUESTS, "t", top=1).axes[0].lines) == 2
