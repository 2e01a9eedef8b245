"""Paths mean the same from any directory: resolved when a spec is parsed, a trace's identity
its content (not its path), the data directory found through one setting or a clear error
before any run. Shipped sweeps run from anywhere."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from testbed.cli.kvtb import main as kvtb
from testbed.run import execute_run
from testbed.spec.flags import add_spec_arguments, spec_from_args
from testbed.spec.inputs import DATA_DIR_ENV, content_digest, data_dir
from testbed.spec.runspec import RunSpec
from testbed.sweep import SweepOptions, load_sweep, run_sweep
from testbed.sweep.experiments import experiment_path

REPO = Path(__file__).resolve().parents[2]
MOONCAKE = REPO.parent / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"
QUIET = SweepOptions(progress=False)
needs_trace = pytest.mark.skipif(not MOONCAKE.is_file(), reason="needs ../shared/data")


def trace(directory: Path, records: int = 6, first_length: int = 600) -> Path:
    """A small Mooncake trace: ``records`` requests sharing their first 512-token block."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tiny.jsonl"
    lines = [
        {
            "timestamp": i,
            "input_length": first_length + 64 * i,
            "output_length": 4,
            "hash_ids": [1, 100 + i],
        }  # fmt: skip
        for i in range(records)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def run_spec_from_cli(*args: str) -> RunSpec:
    """The spec ``kvtb run ARGS`` would run (parsed as the command line parses it)."""
    parser = argparse.ArgumentParser()
    add_spec_arguments(parser)
    return spec_from_args(parser.parse_args(list(args)))


def test_a_relative_trace_path_is_resolved_against_the_working_directory_and_hashed(
    tmp_path, monkeypatch
):
    path = trace(tmp_path / "data")
    monkeypatch.chdir(tmp_path)

    spec = run_spec_from_cli("--workload", "mooncake:data/tiny.jsonl", "--engine", "oracle")

    assert spec.workload == f"mooncake:{path}"
    assert spec.workload_digest == content_digest(path)
    assert spec.workload_digest.startswith("sha256:") and len(spec.workload_digest) == 71


def test_the_run_id_follows_the_traces_content_not_its_path(tmp_path, monkeypatch):
    first = trace(tmp_path / "checkout-a")
    moved = tmp_path / "checkout-b" / "tiny.jsonl"
    moved.parent.mkdir()
    shutil.copy(first, moved)
    monkeypatch.chdir(tmp_path)
    a = run_spec_from_cli("--workload", "mooncake:checkout-a/tiny.jsonl", "--engine", "oracle")
    b = run_spec_from_cli("--workload", f"mooncake:{moved}", "--engine", "oracle")
    assert a.workload != b.workload and a.run_id == b.run_id

    # A run made from one copy is reused from the other: the path is recorded, not compared.
    summary = execute_run(a, tmp_path / "runs")
    assert b.differences(json.loads((tmp_path / "runs" / a.run_id / "spec.json").read_text())) == []
    assert execute_run(b, tmp_path / "runs") == summary

    # Edit the trace: a new identity, and the old run is not reused for it.
    trace(moved.parent, records=7)
    c = run_spec_from_cli("--workload", f"mooncake:{moved}", "--engine", "oracle")
    assert c.workload == b.workload and c.run_id != b.run_id
    assert execute_run(c, tmp_path / "runs")["requests"] == 7


def test_a_trace_that_changed_after_parsing_is_refused_before_the_run(tmp_path):
    path = trace(tmp_path)
    spec = run_spec_from_cli("--workload", f"mooncake:{path}", "--engine", "oracle")
    trace(tmp_path, records=3)
    with pytest.raises(ValueError, match="changed since the spec was parsed"):
        execute_run(spec, tmp_path / "runs")
    assert not (tmp_path / "runs").exists()


def test_a_directory_trace_hashes_its_files_in_order_with_their_names(tmp_path):
    directory = tmp_path / "sessions"
    directory.mkdir()
    (directory / "a.json").write_text("1")
    (directory / "b.json").write_text("2")
    (directory / ".hidden").write_text("ignored")
    before = content_digest(directory)
    (directory / ".hidden").write_text("still ignored")
    assert content_digest(directory) == before
    (directory / "b.json").write_text("3")
    assert content_digest(directory) != before
    (directory / "b.json").write_text("2")
    assert content_digest(directory) == before
    (directory / "b.json").rename(directory / "c.json")
    assert content_digest(directory) != before


def test_paths_in_a_sweep_file_are_relative_to_the_file(tmp_path, monkeypatch):
    path = trace(tmp_path / "experiment" / "traces")
    sweep_file = tmp_path / "experiment" / "mine.toml"
    sweep_file.write_text(
        '[base]\nengine = "oracle"\n[grid]\n'
        'workload = ["chat", "mooncake:traces/tiny.jsonl"]\nrequests = [4]\n'
    )
    monkeypatch.chdir(tmp_path)  # not the file's directory
    sweep = load_sweep(Path("experiment/mine.toml"))
    assert [run.workload for run in sweep.runs] == ["chat", f"mooncake:{path}"]
    assert sweep.swept == ("workload",)  # the digest goes with the workload, not on its own


def test_the_data_directory_comes_from_the_flag_the_variable_or_the_checkout(tmp_path):
    assert data_dir(tmp_path / "flag", env={DATA_DIR_ENV: "/elsewhere"}).origin == "--data-dir"
    from_env = data_dir(env={DATA_DIR_ENV: str(tmp_path)})
    assert (from_env.path, from_env.origin) == (tmp_path, DATA_DIR_ENV)
    checkout = data_dir(env={})
    assert checkout.origin == "the checkout"
    assert checkout.path == REPO.parent / "shared" / "data"


def test_a_spec_naming_the_data_directory_fails_at_parse_time_without_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match=r"does not exist \(the data directory is .*nowhere"):
        run_spec_from_cli("--workload", "mooncake:$KVTB_DATA_DIR/mooncake/trace.jsonl")


@needs_trace
def test_the_shipped_chunk_size_sweep_stops_before_any_run_without_its_data(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "no-data"))

    assert kvtb(["sweep", "chunk_size", "--out", "runs", "--no-progress"]) == 2

    error = capsys.readouterr().err
    assert "conversation_trace.jsonl" in error and "no-data" in error and DATA_DIR_ENV in error
    assert list(tmp_path.iterdir()) == []  # no run started, nothing written


@needs_trace
@pytest.mark.slow
def test_the_shipped_chunk_size_sweep_runs_its_mooncake_runs_from_another_directory(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # not the repository: ../shared/data means nothing here
    monkeypatch.setenv(DATA_DIR_ENV, str(MOONCAKE.parent.parent))
    sweep = load_sweep(experiment_path("chunk_size"))
    traces = [run for run in sweep.runs if run.workload.startswith("mooncake:")]
    assert len(traces) == 10
    assert {run.workload for run in traces} == {f"mooncake:{MOONCAKE}"}
    # One of the ten, in a run process of its own as every sweep run is: it reads the trace.
    chosen = tuple(run for run in traces if run.chunk_size == 1024 and run.engine == "oracle")
    result = run_sweep(dataclasses.replace(sweep, runs=chosen), Path("runs"), QUIET)
    assert result.failed == () and len(result.executed) == 1
    summary = json.loads((tmp_path / "runs" / "chunk_size" / chosen[0].run_id / "summary.json")
                         .read_text())  # fmt: skip
    assert summary["requests"] + summary["requests_rejected"] == 200
