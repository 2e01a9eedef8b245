"""``load_spans`` reads a run, a sweep (its complete runs, in order) or a directory of runs."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest

from testbed.analysis import load_events, load_spans
from testbed.analysis.spans import run_dirs
from testbed.core import telemetry
from testbed.core.telemetry import attributes as a
from testbed.core.telemetry.setup import TracingConfig, configure_tracing
from testbed.sweep.index import write_manifest
from testbed.sweep.spec import load_sweep

CHUNK_SIZES = [64, 128, 256]


@pytest.fixture(scope="module")
def sweep_of_three(tmp_path_factory):
    """A sweep directory (the sweep code's own manifest) whose three runs' spans the real SDK
    and file exporter wrote, as a run's processes do: requests with store batches and events."""
    out = tmp_path_factory.mktemp("runs")
    path = out / "three.toml"
    path.write_text(
        f'name = "three"\n[base]\nworkload = "chat"\n[grid]\nchunk_size = {CHUNK_SIZES}\n'
    )
    sweep = load_sweep(path)
    sweep_dir = out / sweep.name
    write_manifest(sweep_dir, sweep)
    for index, run in enumerate(sweep.runs):
        run_dir = sweep_dir / run.run_id
        resource = {"kvcache.chunk_size": run.chunk_size, "kvcache.engine": run.engine}
        tracing = configure_tracing(
            TracingConfig("kvtb-engine", run_dir=run_dir, run_id=run.run_id, resource=resource)
        )
        assert tracing is not None
        for request in range(3 + index):  # runs of different sizes
            request_id = f"chat-{request:05d}"
            with (
                telemetry.traced(a.REQUEST, attributes={a.REQUEST_ID: request_id}),
                telemetry.traced(a.CONNECTOR_STORE, attributes={a.CHUNKS: 2}) as span,
            ):
                span.add_event(a.ITEM_EVENT, {a.REQUEST_ID: request_id, a.CHUNKS: 2})
        tracing.shutdown()
        (run_dir / "spec.json").write_text(json.dumps({"run_id": run.run_id, **run.to_dict()}))
        (run_dir / "summary.json").write_text(json.dumps({"run_id": run.run_id}))
    return sweep_dir, list(sweep.run_ids)


def test_a_sweep_loads_as_the_rows_of_its_runs_in_sweep_order(sweep_of_three):
    sweep_dir, run_ids = sweep_of_three
    spans = load_spans(sweep_dir)
    per_run = [load_spans(sweep_dir / run_id) for run_id in run_ids]
    assert all(len(frame) for frame in per_run)
    assert list(spans["span_id"]) == [s for frame in per_run for s in frame["span_id"]]
    assert list(pd.unique(spans["run_id"])) == run_ids
    for run_id, frame in zip(run_ids, per_run, strict=True):
        assert (frame["run_id"] == run_id).all()
        rows = spans[spans["run_id"] == run_id]
        assert list(rows[a.REQUEST_ID]) == list(frame[a.REQUEST_ID])
    # Each run's own parameters, as integers (not floats widened by the concatenation).
    chunk_sizes = spans.groupby("run_id")["resource.kvcache.chunk_size"].unique()
    spec_sizes = {
        run_id: json.loads((sweep_dir / run_id / "spec.json").read_text())["chunk_size"]
        for run_id in run_ids
    }
    assert {run_id: list(values) for run_id, values in chunk_sizes.items()} == {
        run_id: [size] for run_id, size in spec_sizes.items()
    }
    assert str(spans["resource.kvcache.chunk_size"].dtype) == "Int64"
    events = load_events(sweep_dir)
    assert events.groupby("run_id").size().to_dict() == {r: 3 + i for i, r in enumerate(run_ids)}


def test_only_complete_runs_count_and_a_plain_directory_of_runs_works_too(sweep_of_three, tmp_path):
    sweep_dir, run_ids = sweep_of_three
    collection = tmp_path / "collection"
    for run_id in run_ids:
        shutil.copytree(sweep_dir / run_id, collection / run_id)
    (collection / run_ids[1] / "summary.json").unlink()  # as if it were still running
    (collection / "notes").mkdir()

    expected = [r for r in sorted(run_ids) if r != run_ids[1]]
    assert [p.name for p in run_dirs(collection)] == expected
    assert list(pd.unique(load_spans(collection)["run_id"])) == expected
    # A run directory itself is read whole, complete or not.
    assert len(load_spans(collection / run_ids[1])) == len(load_spans(sweep_dir / run_ids[1]))


def test_a_directory_without_runs_is_refused_with_what_was_expected(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a run directory"):
        load_spans(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_spans(tmp_path / "missing")
