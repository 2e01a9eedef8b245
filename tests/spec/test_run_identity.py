"""Run identity: two different resolved specs never share a finished run."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from testbed.run import execute_run, is_reusable, reuse_differences
from testbed.spec import runspec
from testbed.spec.runspec import RunSpec
from testbed.sweep import SweepOptions, expand_sweep, run_sweep
from testbed.sweep.index import record_failure

ORACLE = {"engine": "oracle", "requests": 3}


def set_default(monkeypatch, name, value):
    """Changes a RunSpec field's default, as a new version of the code would."""
    names = [f.name for f in dataclasses.fields(RunSpec)]
    defaults = list(RunSpec.__init__.__defaults__)
    defaults[names.index(name)] = value
    monkeypatch.setattr(RunSpec.__init__, "__defaults__", tuple(defaults))
    monkeypatch.setattr(RunSpec.__dataclass_fields__[name], "default", value)


def summary_mtime(run_dir):
    return (run_dir / "summary.json").stat().st_mtime_ns


def test_changing_a_default_makes_a_finished_run_be_redone_not_reused(tmp_path, monkeypatch):
    before = RunSpec(**ORACLE)
    first = execute_run(before, tmp_path)
    done = summary_mtime(tmp_path / before.run_id)

    set_default(monkeypatch, "max_output_tokens", 4)
    after = RunSpec(**ORACLE)  # the same keys as before: only the default moved
    assert after.max_output_tokens == 4
    assert after.run_id != before.run_id
    assert after.differences(json.loads((tmp_path / before.run_id / "spec.json").read_text())) == [
        "max_output_tokens: 16 in spec.json, now 4"
    ]
    second = execute_run(after, tmp_path)
    assert second["run_id"] == after.run_id != first["run_id"]
    assert json.loads((tmp_path / after.run_id / "spec.json").read_text())["max_output_tokens"] == 4
    assert summary_mtime(tmp_path / before.run_id) == done  # the old run is left as it was


def test_a_finished_run_is_reused_only_if_its_spec_json_equals_the_spec(tmp_path, caplog):
    spec = RunSpec(**ORACLE)
    run_dir = tmp_path / spec.run_id
    execute_run(spec, tmp_path)
    done = summary_mtime(run_dir)
    assert is_reusable(run_dir, spec)
    execute_run(spec, tmp_path)
    assert summary_mtime(run_dir) == done  # reused

    # An older spec.json: no schema version, one field missing, another with another value.
    stored = json.loads((run_dir / "spec.json").read_text())
    del stored["spec_schema"], stored["fault_drop_fraction"]
    stored["seed"] = 7
    (run_dir / "spec.json").write_text(json.dumps(stored))
    assert reuse_differences(run_dir, spec) == [
        f"spec_schema: 1 in spec.json, now {runspec.SPEC_SCHEMA}",
        "fault_drop_fraction: missing in spec.json, now 0.0",
        "seed: 7 in spec.json, now 0",
    ]
    with caplog.at_level(logging.WARNING, logger="testbed.run"):
        execute_run(spec, tmp_path)
    assert "is not reused" in caplog.text and "fault_drop_fraction" in caplog.text
    assert summary_mtime(run_dir) != done  # redone
    assert is_reusable(run_dir, spec)
    assert reuse_differences(tmp_path / "nothing", spec) is None


def test_a_documented_migration_lets_older_runs_lacking_a_field_be_reused(monkeypatch):
    spec = RunSpec(**ORACLE)
    stored = spec.document()
    del stored["fault_drop_fraction"]
    assert spec.differences(stored) == ["fault_drop_fraction: missing in spec.json, now 0.0"]
    # As if fault_drop_fraction had been added later, 0.0 reproducing what older runs did:
    # its default no longer enters the id, and a spec.json without it means 0.0.
    monkeypatch.setattr(runspec, "SPEC_MIGRATIONS", {"fault_drop_fraction": 0.0})
    assert spec.differences(stored) == []
    assert spec.run_id != dataclasses.replace(spec, fault_drop_fraction=0.5).run_id
    assert dataclasses.replace(spec, fault_drop_fraction=0.5).differences(stored) == [
        "fault_drop_fraction: 0.0 in spec.json, now 0.5"
    ]


def test_run_ids_hash_every_field_and_the_schema(monkeypatch):
    spec = RunSpec(**ORACLE)
    assert spec.run_id == RunSpec(**ORACLE, seed=0).run_id  # a default written out
    assert spec.run_id != dataclasses.replace(spec, seed=1).run_id
    original = spec.run_id
    monkeypatch.setattr(runspec, "SPEC_SCHEMA", runspec.SPEC_SCHEMA + 1)
    assert spec.run_id != original


@pytest.mark.slow
def test_a_sweep_redoes_only_the_run_whose_spec_json_differs(tmp_path, caplog):
    sweep = expand_sweep(
        {"base": ORACLE, "grid": {"chunk_size": [128, 256]}}, source="test", default_name="ids"
    )
    options = SweepOptions(progress=False)
    first = run_sweep(sweep, tmp_path, options)
    assert sorted(first.executed) == sorted(sweep.run_ids)
    stale = sweep.run_ids[0]
    path = tmp_path / "ids" / stale / "spec.json"
    stored = json.loads(path.read_text())
    stored["max_output_tokens"] = 99
    path.write_text(json.dumps(stored))
    with caplog.at_level(logging.WARNING, logger="testbed.sweep.cli"):
        second = run_sweep(sweep, tmp_path, options)
    assert second.executed == (stale,) and second.skipped == (sweep.run_ids[1],)
    assert "max_output_tokens: 99 in spec.json, now 16" in caplog.text
    assert json.loads(path.read_text())["max_output_tokens"] == 16
    assert run_sweep(sweep, tmp_path, options).executed == ()


@pytest.mark.parametrize("key", ["run_id", "effective"])
def test_keys_that_are_not_fields_are_not_compared(key):
    spec = RunSpec(**ORACLE)
    stored = {**spec.document(), key: {"block_size": 32}}
    assert spec.differences(stored) == []


def test_a_failed_run_is_never_reused_whatever_killed_it(tmp_path, caplog):
    spec = RunSpec(**ORACLE)
    run_dir = tmp_path / spec.run_id
    execute_run(spec, tmp_path)
    assert is_reusable(run_dir, spec)

    # Its process was killed after the summary was written: whoever saw it die recorded it.
    record_failure(run_dir, spec, "run process exited with code -9")
    assert reuse_differences(run_dir, spec) == ["the run failed (run process exited with code -9)"]
    with caplog.at_level(logging.WARNING, logger="testbed.run"):
        execute_run(spec, tmp_path)
    assert "exited with code -9" in caplog.text and "redoing it" in caplog.text
    assert not (run_dir / "error.txt").exists() and is_reusable(run_dir, spec)

    # Its summary lists what went wrong (a dead server, missing telemetry, ...).
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["failures"] = ["the cache server stopped answering during the run"]
    (run_dir / "summary.json").write_text(json.dumps(summary))
    assert not is_reusable(run_dir, spec)
    assert execute_run(spec, tmp_path)["failures"] == []
