"""open_source: a run, a sweep or a directory of runs as one table of runs."""

from __future__ import annotations

import pandas as pd
import pytest

from testbed.analysis.source import open_source
from testbed.analysis.tables import figure_axes
from testbed.spec.runspec import RunSpec
from tests.analysis.run_dirs import write_run, write_sweep

SUMMARY = {"requests": 3, "token_hit_rate": 0.5, "tokens": {"cold": 7, "external": 2}}


def _tp_mla_sweep(tmp_path):
    sweep = tmp_path / "tp_mla"
    runs = [
        write_run(sweep, RunSpec(tp=tp, mla=mla, requests=4), SUMMARY)
        for tp in (1, 2)
        for mla in (False, True)
    ]
    runs.append(write_run(sweep, RunSpec(engine="oracle", requests=4), SUMMARY))
    failed = sweep / "failed"
    (failed / "spans").mkdir(parents=True)  # no summary.json: never finished
    return write_sweep(tmp_path, "tp_mla", ["tp", "mla", "engine"], [*runs, failed]), runs


def test_a_sweep_is_its_complete_runs_in_order_with_axes_and_labels(tmp_path):
    sweep_dir, runs = _tp_mla_sweep(tmp_path)
    source = open_source(sweep_dir)
    assert source.kind == "sweep" and source.name == "tp_mla"
    assert list(source.runs["run_id"]) == [path.name for path in runs]
    assert (source.x, source.series) == ("tp", ("mla",))
    assert list(source.runs["label"]) == [
        "replay tp=1 mla=False",
        "replay tp=1 mla=True",
        "replay tp=2 mla=False",
        "replay tp=2 mla=True",
        "oracle tp=1 mla=False",
    ]
    row = source.runs.iloc[0]
    # Named as in a sweep's index: the served count beside the asked-for one, tables flat.
    assert (row["requests"], row["summary_requests"]) == (4, 3)
    assert (row["tokens_cold"], row["tokens_external"]) == (7, 2)
    assert "spec_schema" not in source.runs
    assert list(source.measured["engine"]) == ["replay"] * 4
    assert list(source.oracles["run_id"]) == [runs[-1].name]
    assert list(source.dirs()) == list(source.measured["label"])
    assert source.run(runs[0].name).path == runs[0]
    assert source.first_measured().path == source.measured_run().path == runs[0]


def test_a_run_directory_is_one_run_labelled_by_its_id(tmp_path):
    run_dir = write_run(tmp_path, RunSpec(requests=4), SUMMARY)
    source = open_source(run_dir)
    assert source.kind == "run"
    assert (source.x, source.series, source.swept) == ("run_id", (), [])
    assert list(source.runs["label"]) == [f"replay {run_dir.name}"]


def test_a_directory_of_runs_is_swept_over_the_keys_that_differ(tmp_path):
    for chunk_size in (64, 128):
        write_run(tmp_path / "runs", RunSpec(chunk_size=chunk_size, requests=4), SUMMARY)
    source = open_source(tmp_path / "runs")
    assert source.kind == "sweep"
    assert (source.x, source.series) == ("chunk_size", ())
    assert sorted(source.runs["label"]) == ["replay chunk_size=128", "replay chunk_size=64"]


def test_a_directory_without_complete_runs_says_so(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError):
        open_source(tmp_path / "empty")


def test_a_source_of_oracle_runs_has_no_run_to_show(tmp_path):
    source = open_source(write_run(tmp_path, RunSpec(engine="oracle", requests=4), SUMMARY))
    assert source.first_measured() is None and source.measured.empty
    with pytest.raises(ValueError, match="oracle runs only"):
        source.measured_run()


def test_figure_axes_prefer_a_numeric_key_and_keep_the_keys_that_tell_runs_apart():
    runs = pd.DataFrame(
        {
            "workload": ["chat", "chat", "rag", "rag"],
            "engine_blocks": [64, 64, 2048, 2048],  # linked to the workload: no series of its own
            "chunk_size": [64, 128, 64, 128],
            "engine": ["replay"] * 4,
        }
    )
    swept = ["workload", "engine_blocks", "chunk_size", "engine"]
    assert figure_axes(swept, runs) == ("chunk_size", ["workload"])
    assert figure_axes(swept) == ("chunk_size", ["workload", "engine_blocks"])
    assert figure_axes(["engine"]) == ("run_id", [])
