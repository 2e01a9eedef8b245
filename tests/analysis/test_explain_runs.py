"""``kvtb explain`` on a sweep: the request in each measured run, labelled, or in the run
``--run`` names; on any id of the request; with the attribution's own categories."""

from __future__ import annotations

import pandas as pd
import pytest

from testbed.analysis.attribution import CATEGORIES
from testbed.analysis.explain import Explainer, explain
from testbed.analysis.explain_runs import explain_runs
from testbed.analysis.source import open_source
from testbed.cli.kvtb import main as kvtb


@pytest.fixture(scope="module")
def capacity_miss(small_sweep) -> tuple[str, str]:
    """(run id, workload request id) of a request whose first miss was a capacity miss."""
    runs = open_source(small_sweep).measured
    for run_id in runs["run_id"]:
        table = pd.read_parquet(small_sweep / run_id / "metrics.parquet")
        missed = table[table["capacity"] > 0]
        if len(missed):
            return str(run_id), str(missed["workload_request_id"].iloc[0])
    raise AssertionError("the small sweep has no capacity miss")


@pytest.mark.vllm
def test_explain_on_a_sweep_tells_the_story_in_each_run_labelled(
    small_sweep, capacity_miss, capsys
):
    run_id, request_id = capacity_miss
    source = open_source(small_sweep)

    assert kvtb(["explain", str(small_sweep), request_id]) == 0

    printed = capsys.readouterr().out
    for row in source.measured.itertuples():
        assert f"== run {row.run_id}: {row.label}\nrequest " in printed
    oracle = source.oracles["run_id"].iloc[0]
    assert f"oracle runs have no telemetry to explain from: {oracle}" in printed
    explained = explain_runs(small_sweep, request_id)
    story = next(s.story for s in explained.stories if s.run_id == run_id)
    assert story.tokens["capacity"] > 0 and "capacity" in printed

    assert kvtb(["explain", str(small_sweep), request_id, "--run", run_id]) == 0
    only = capsys.readouterr().out
    assert only.count("== run ") == 1 and f"== run {run_id}:" in only

    assert kvtb(["explain", str(small_sweep), request_id, "--run", "nope"]) == 2
    assert "is not a run of" in capsys.readouterr().err
    assert kvtb(["explain", str(small_sweep), "chat-3"]) == 2
    assert "no request 'chat-3'" in capsys.readouterr().err
    with pytest.raises(LookupError, match="not a run directory"):
        explain(small_sweep, request_id)


@pytest.mark.vllm
def test_every_story_has_the_attributions_categories_and_first_cause(small_sweep):
    for run_id in open_source(small_sweep).measured["run_id"]:
        run_dir = small_sweep / run_id
        table = pd.read_parquet(run_dir / "metrics.parquet").set_index("request_id")
        explainer = Explainer(run_dir)
        for request_id, row in table.iterrows():
            story = explainer.explain(str(request_id))
            expected = {name: int(row[name]) for name in CATEGORIES}
            assert story.tokens == expected
            by_segment = dict.fromkeys(CATEGORIES, 0)
            for segment in story.segments:
                by_segment[segment.category] += segment.num_tokens
            assert by_segment == expected, (run_id, request_id)
            if story.first_miss is not None:
                assert expected[story.first_miss.cause] > 0
