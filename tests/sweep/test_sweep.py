"""Sweeps: grid expansion and validation, resumable execution, Ctrl-C, failures, Ray, the index.

Most runs use the oracle engine (no server, about a second each); one sweep runs the replay
engine with real cache servers to check that an interrupted sweep leaves none behind.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from testbed.cli import demo as demo_cli
from testbed.cli.kvtb import main as kvtb
from testbed.spec.runspec import RunSpec
from testbed.sweep import SweepOptions, build_index, load_index, load_sweep, run_sweep
from testbed.sweep.executors import RunProcess
from testbed.sweep.index import ERROR_FILE, INDEX_FILE, SWEEP_FILE, SWEEP_TOML
from tests.support.signals import default_sigint

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "experiments" / "quickstart.toml"
QUIET = SweepOptions(progress=False)
ORACLE_BASE = """
[base]
engine = "oracle"
workload = "chat"
requests = 20
"""
HIT_RATES = ["run_id", "status", "token_hit_rate", "mean_request_hit_rate", "external_hit_tokens"]


def write(tmp_path: Path, text: str, name: str = "sweep") -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


def summary_mtimes(sweep_dir: Path) -> dict[str, int]:
    return {path.parent.name: path.stat().st_mtime_ns for path in sweep_dir.glob("*/summary.json")}


def cache_servers(under: Path) -> list[int]:
    """Pids of live ``python -m server`` processes whose run directory is below ``under``."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"-m" in args and b"server" in args and any(str(under).encode() in arg for arg in args):
            pids.append(int(cmdline.parent.name))
    return pids


def run_processes_of(pid: int) -> list[int]:
    """Pids of the run processes a sweep started: the children of its fork server (not the
    fork server itself, nor multiprocessing's resource tracker)."""
    processes = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        processes.append((int(stat.parent.name), parent, cmdline))
    servers = {p for p, parent, cmdline in processes if parent == pid and b"forkserver" in cmdline}
    return [p for p, parent, _ in processes if parent in servers]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# ---------------------------------------------------------------------------------------------
# Sweep files
# ---------------------------------------------------------------------------------------------


def test_grid_expands_in_order_with_excludes_includes_and_duplicates_once(tmp_path):
    path = write(
        tmp_path,
        ORACLE_BASE
        + """
workload_params = { turns = 2 }

[grid]
chunk_size = [128, 256]
policy = ["lru", "belady"]
capacity_tokens = [4096]

[[exclude]]
chunk_size = 256
policy = "belady"

[[include]]  # the same run as the first grid combination: run once
chunk_size = 128
policy = "lru"
capacity_tokens = 4096

[[include]]
chunk_size = 512
workload_params = { concurrent_conversations = 2 }
""",
        name="grid",
    )
    sweep = load_sweep(path)

    assert sweep.name == "grid"  # the file's stem
    assert [(r.chunk_size, r.policy, r.capacity_tokens) for r in sweep.runs] == [
        (128, "lru", 4096),
        (128, "belady", 4096),
        (256, "lru", 4096),
        (512, "lru", None),
    ]
    assert sweep.runs[3].workload_params == {"turns": 2, "concurrent_conversations": 2}
    assert sweep.swept == ("chunk_size", "policy", "capacity_tokens", "workload_params")
    assert len(set(sweep.run_ids)) == 4


def test_run_ids_depend_on_the_resolved_spec_only(tmp_path):
    one = load_sweep(write(tmp_path, ORACLE_BASE + "[grid]\nchunk_size = [128, 256]\n", name="a"))
    # Same runs, spelt differently: keys reordered, a default written out, a base key in the grid.
    other = load_sweep(
        write(
            tmp_path,
            '[base]\nrequests = 20\nseed = 0\nworkload = "chat"\n'
            '[grid]\nengine = ["oracle"]\nchunk_size = [128, 256]\n',
            name="b",
        )
    )
    direct = RunSpec(engine="oracle", workload="chat", requests=20, chunk_size=128)

    assert one.run_ids == other.run_ids == load_sweep(tmp_path / "a.toml").run_ids
    assert one.run_ids[0] == direct.run_id
    assert one.run_ids[0] != one.run_ids[1]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[base]\nchunk_sise = 128\n", ["'chunk_sise'", "[base]"]),
        ("[grid]\nchunk_sise = [64, 128]\n", ["'chunk_sise'", "[grid]"]),
        ("[[include]]\nengin = 'oracle'\n", ["'engin'", "[[include]] #1"]),
        ("[grid]\nchunk_size = [64]\n[[exclude]]\npolcy = 'lru'\n", ["'polcy'", "[[exclude]] #1"]),
    ],
)
def test_misspelt_run_key_fails_before_any_run_naming_key_file_and_valid_keys(
    tmp_path, text, expected
):
    path = write(tmp_path, text)
    with pytest.raises(ValueError) as error:
        load_sweep(path)
    message = str(error.value)
    for part in [str(path), *expected, "valid keys: engine, workload, requests"]:
        assert part in message

    # Through the command line: exit code 2 and nothing created.
    assert kvtb(["sweep", str(path), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "[grids]\nchunk_size = [64]\n",
            "unknown top-level key 'grids'; valid keys: name, description, base",
        ),
        ("[grid]\nchunk_size = []\n", "[grid]: chunk_size is an empty list"),
        ("[grid]\nchunk_size = 64\n", "[grid]: chunk_size must be a list"),
        ("[grid]\nchunk_size = [64, 'big']\n", "chunk_size = 'big' is not a value of type int"),
        # The cache server has no Belady (the oracle has): this combination needs an [[exclude]].
        (
            "[grid]\nengine = ['replay', 'oracle']\npolicy = ['belady']\n",
            "policy 'belady' is not available with engine replay",
        ),
        (
            "[grid]\nchunk_size = [64]\n[[exclude]]\nchunk_size = 65\n",
            "[[exclude]] #1: {chunk_size = 65} matches no grid",
        ),
        ("name = '../elsewhere'\n", "sweep name '../elsewhere' must be a plain directory name"),
    ],
)
def test_invalid_sweep_files_fail_with_the_file_and_the_reason(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(ValueError) as error:
        load_sweep(path)
    assert expected in str(error.value)
    assert str(error.value).startswith(str(path))


# ---------------------------------------------------------------------------------------------
# Execution and the index
# ---------------------------------------------------------------------------------------------


def test_rerun_skips_complete_runs_and_redoes_only_a_crashed_one(tmp_path):
    path = write(tmp_path, ORACLE_BASE + "[grid]\nchunk_size = [64, 128, 256]\n", name="resume")
    sweep = load_sweep(path)
    options = SweepOptions(jobs=2, progress=False)

    first = run_sweep(sweep, tmp_path / "runs", options)
    sweep_dir = tmp_path / "runs" / "resume"
    assert first.sweep_dir == sweep_dir
    assert sorted(first.executed) == sorted(sweep.run_ids) and first.failed == ()
    assert (sweep_dir / SWEEP_TOML).read_text() == path.read_text()
    assert json.loads((sweep_dir / SWEEP_FILE).read_text()) == {
        "name": "resume",
        "description": "",
        "swept": ["chunk_size"],
        "runs": sweep.run_ids,
    }
    done = summary_mtimes(sweep_dir)

    second = run_sweep(sweep, tmp_path / "runs", options)
    assert second.executed == () and second.skipped == tuple(sweep.run_ids)
    assert summary_mtimes(sweep_dir) == done

    crashed = sweep.run_ids[1]
    (sweep_dir / crashed / "summary.json").unlink()  # as if killed mid-run
    third = run_sweep(sweep, tmp_path / "runs", options)
    assert third.executed == (crashed,)
    after = summary_mtimes(sweep_dir)
    assert {k: v for k, v in after.items() if k != crashed} == {
        k: v for k, v in done.items() if k != crashed
    }

    index = load_index(sweep_dir)
    assert list(index["run_id"]) == sweep.run_ids
    assert list(index["status"]) == ["complete"] * 3
    assert list(index.columns[:4]) == ["run_id", "status", "error", "engine"]
    assert list(index["chunk_size"]) == [64, 128, 256]
    assert json.loads(index["workload_params"][0]) == {}
    assert index["token_hit_rate"].between(0.5, 1).all()  # chat reuses its system prompt


def test_failed_run_is_recorded_and_the_others_complete(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")  # there, so the file parses; no requests in it
    path = write(
        tmp_path,
        ORACLE_BASE
        + "[grid]\nworkload = ['chat', 'mooncake:empty.jsonl']\nchunk_size = [128, 256]\n",
        name="failing",
    )
    sweep = load_sweep(path)
    out = tmp_path / "runs"

    assert kvtb(["sweep", str(path), "--out", str(out), "--jobs", "2", "--no-progress"]) == 1

    sweep_dir = out / "failing"
    index = pd.read_parquet(sweep_dir / INDEX_FILE)
    assert list(index["run_id"]) == sweep.run_ids
    assert list(index["status"]) == ["complete", "complete", "failed", "failed"]
    assert index["error"][:2].isna().all()
    assert all("has no requests" in error for error in index["error"][2:])
    assert index["token_hit_rate"][:2].notna().all() and index["token_hit_rate"][2:].isna().all()
    failed = list(index["run_id"][2:])
    assert "Traceback" in (sweep_dir / failed[0] / ERROR_FILE).read_text()

    # The index is rebuilt from the run directories alone.
    (sweep_dir / INDEX_FILE).unlink()
    pd.testing.assert_frame_equal(build_index(sweep_dir), index)

    # Failed runs are retried by the next invocation; complete ones are not.
    again = run_sweep(sweep, out, QUIET)
    assert sorted(again.executed) == sorted(failed) and sorted(again.failed) == sorted(failed)


@pytest.mark.slow
def test_interrupted_sweep_leaves_no_server_and_resumes_with_only_the_missing_runs(tmp_path):
    path = write(
        tmp_path,
        '[base]\nworkload = "chat"\nrequests = 12\n'
        '[grid]\nengine = ["oracle", "replay"]\nchunk_size = [128, 256]\n',
        name="killed",
    )
    sweep = load_sweep(path)
    out = tmp_path / "runs"
    sweep_dir = out / "killed"
    with open(tmp_path / "sweep.log", "w") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "testbed.cli",
                "sweep",
                str(path),
                "--out",
                str(out),
                "--no-progress",
            ],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=default_sigint,
        )
    try:
        deadline = time.monotonic() + 90
        while not (summary_mtimes(sweep_dir) and cache_servers(tmp_path)):  # a replay run is going
            assert process.poll() is None, (tmp_path / "sweep.log").read_text()
            assert time.monotonic() < deadline, "no replay run started"
            time.sleep(0.2)
        run_processes = run_processes_of(process.pid)
        assert run_processes

        process.send_signal(signal.SIGINT)
        try:
            assert process.wait(20) == 130
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            pytest.fail("the sweep did not stop within 20 s of SIGINT")
    finally:
        if process.poll() is None:
            process.kill()
    assert "interrupted" in (tmp_path / "sweep.log").read_text()
    assert cache_servers(tmp_path) == []
    assert not any(alive(pid) for pid in run_processes)

    complete = set(summary_mtimes(sweep_dir))
    assert 1 <= len(complete) < len(sweep.runs)
    result = run_sweep(sweep, out, SweepOptions(jobs=2, progress=False))
    assert set(result.executed) == set(sweep.run_ids) - complete
    assert set(result.skipped) == complete
    index = load_index(sweep_dir)
    assert list(index["run_id"]) == sweep.run_ids
    assert (index["status"] == "complete").all()
    assert (index.loc[index["engine"] == "replay", "integrity_errors"] == 0).all()
    assert cache_servers(tmp_path) == []


@pytest.mark.slow
def test_ray_executor_gives_the_same_index_as_the_local_one(tmp_path):
    pytest.importorskip("ray", reason="the Ray executor needs ray (pip install 'kvtestbed[ray]')")
    path = write(
        tmp_path,
        ORACLE_BASE
        + "capacity_tokens = 2048\n[grid]\nchunk_size = [64, 256]\npolicy = ['lru', 'belady']\n",
        name="ray",
    )
    sweep = load_sweep(path)

    local = run_sweep(sweep, tmp_path / "local", SweepOptions(jobs=2, progress=False))
    on_ray = run_sweep(
        sweep, tmp_path / "ray", SweepOptions(executor="ray", jobs=2, progress=False)
    )

    assert sorted(on_ray.executed) == sorted(sweep.run_ids) and on_ray.failed == ()
    local_index = load_index(local.sweep_dir)[HIT_RATES]
    ray_index = load_index(on_ray.sweep_dir)[HIT_RATES]
    pd.testing.assert_frame_equal(local_index, ray_index)
    assert (local_index["status"] == "complete").all()
    # Belady beats LRU at the same capacity (the runs really differ).
    rates = load_index(local.sweep_dir).set_index(["chunk_size", "policy"])["token_hit_rate"]
    assert rates[(64, "belady")] >= rates[(64, "lru")]


def test_a_run_process_that_dies_without_a_word_is_a_failed_run(tmp_path):
    spec = RunSpec(engine="oracle", requests=5, workload="chat")
    run = RunProcess(spec, tmp_path)
    os.kill(run.process.pid, signal.SIGKILL)  # as the out-of-memory killer would

    outcome = run.wait()

    assert not outcome.ok and outcome.error == "run process exited with code -9"
    assert (tmp_path / spec.run_id / ERROR_FILE).read_text().startswith(outcome.error)
    assert json.loads((tmp_path / spec.run_id / "spec.json").read_text())["run_id"] == spec.run_id


def test_stopping_a_killed_run_stops_the_server_it_had_started(tmp_path):
    # The run's cache server leads a group of its own, outside the run's: killed at once
    # (no shutdown of its own, as when a sweep's grace runs out), the run cannot stop it; the
    # run named the group to its parent when it started it, and stop() stops it.
    spec = RunSpec(engine="replay", requests=400, workload="chat")
    run = RunProcess(spec, tmp_path)
    deadline = time.monotonic() + 120
    while not cache_servers(tmp_path):
        assert run.process.exitcode is None and time.monotonic() < deadline, "no server started"
        time.sleep(0.05)
    (server,) = cache_servers(tmp_path)
    os.kill(run.process.pid, signal.SIGKILL)

    run.stop(grace_s=0.0)

    assert cache_servers(tmp_path) == [], f"server {server} outlived its stopped run"


def test_quickstart_is_a_small_sweep_of_both_engines():
    sweep = load_sweep(QUICKSTART)
    assert sweep.name == "quickstart"
    assert {run.engine for run in sweep.runs} == {"replay", "oracle"}
    assert {run.workload for run in sweep.runs} == {"chat", "rag"}
    assert None in {run.capacity_tokens for run in sweep.runs} and "capacity_tokens" in sweep.swept
    assert len(sweep.runs) <= 12 and all(run.requests <= 200 for run in sweep.runs)
    # Keys linked to the workload (its size and parameters) stay out of run labels.
    assert sweep.label_keys == ("workload", "capacity_tokens", "engine")


def test_demo_runs_its_sweep_and_writes_the_report(tmp_path, monkeypatch, capsys):
    # The oracle half of the quickstart (the replay half runs in the interrupted-sweep test).
    text = QUICKSTART.read_text().replace('engine = ["replay", "oracle"]', 'engine = ["oracle"]')
    assert text != QUICKSTART.read_text()
    monkeypatch.setattr(demo_cli, "QUICKSTART", write(tmp_path, text, name="quickstart"))

    assert demo_cli.demo(tmp_path / "runs") == 0

    printed = capsys.readouterr().out.strip().splitlines()
    (line,) = [line for line in printed if line.startswith("report: ")]
    report = Path(line.removeprefix("report: "))
    assert report.is_file() and report.is_relative_to(tmp_path / "runs" / "quickstart")
    assert (load_index(tmp_path / "runs" / "quickstart")["status"] == "complete").all()


def test_ray_executor_without_ray_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray → ImportError
    path = write(tmp_path, ORACLE_BASE)
    out = tmp_path / "runs"

    assert kvtb(["sweep", str(path), "--out", str(out), "--executor", "ray"]) == 2
    assert "pip install 'kvtestbed[ray]'" in capsys.readouterr().err
    assert not out.exists()


def test_a_sweep_directory_in_use_is_refused(tmp_path):
    sweep = load_sweep(write(tmp_path, ORACLE_BASE, name="busy"))
    (tmp_path / "runs" / "busy").mkdir(parents=True)
    with open(tmp_path / "runs" / "busy" / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as another `kvtb sweep` holds it
        with pytest.raises(ValueError, match="in use by another kvtb sweep"):
            run_sweep(sweep, tmp_path / "runs", QUIET)
    assert run_sweep(sweep, tmp_path / "runs", QUIET).executed == tuple(sweep.run_ids)


def test_a_linked_grid_dimension_varies_several_keys_together(tmp_path):
    sweep = load_sweep(
        write(
            tmp_path,
            ORACLE_BASE
            + """
[grid]
setup = [
    { workload = "chat", engine_blocks = 64, workload_params = { turns = 2 } },
    { workload = "rag", engine_blocks = 512 },
]
chunk_size = [64, 128]
""",
        )
    )
    pairs = [(run.workload, run.engine_blocks, run.chunk_size) for run in sweep.runs]
    assert pairs == [("chat", 64, 64), ("chat", 64, 128), ("rag", 512, 64), ("rag", 512, 128)]
    assert sweep.runs[0].workload_params == {"turns": 2} and sweep.runs[2].workload_params == {}
    assert {"workload", "engine_blocks", "chunk_size"} <= set(sweep.swept)
    with pytest.raises(ValueError, match=r"\[grid\] setup #2: unknown key 'workloud'"):
        load_sweep(
            write(
                tmp_path,
                ORACLE_BASE + '[grid]\nsetup = [{workload = "chat"}, {workloud = "rag"}]\n',
                "bad",
            )
        )


def test_report_takes_the_out_directory_of_plain_runs(tmp_path, capsys):
    out = tmp_path / "runs"
    common = ["run", "--engine", "oracle", "--workload", "chat", "--requests", "20"]
    assert kvtb([*common, "--out", str(out), "--no-progress"]) == 0
    assert kvtb([*common, "--capacity-tokens", "2000", "--out", str(out), "--no-progress"]) == 0
    assert not (out / SWEEP_FILE).exists()
    capsys.readouterr()

    assert kvtb(["report", str(out)]) == 0

    report = (out / "report" / "report.md").read_text()
    assert "2 finished runs" in report and "Swept: capacity_tokens." in report
    table = pd.read_csv(out / "report" / "runs.csv")
    assert sorted(table["capacity_tokens"].fillna(-1)) == [-1, 2000]
    assert (out / "report" / "hit_rate.png").is_file()


def test_report_of_a_directory_without_runs_says_what_to_give(tmp_path, capsys):
    assert kvtb(["report", str(tmp_path)]) != 0
    assert "kvtb run" in capsys.readouterr().err


def test_set_overrides_a_run_key_in_every_run_of_a_sweep(tmp_path, capsys):
    sweep = load_sweep(QUICKSTART, overrides={"requests": 8})
    assert {run.requests for run in sweep.runs} == {8}
    assert len(sweep.runs) == len(load_sweep(QUICKSTART).runs)
    with pytest.raises(ValueError, match="--set: unknown key 'reqests'"):
        load_sweep(QUICKSTART, overrides={"reqests": 8})
    path = write(tmp_path, ORACLE_BASE + "[grid]\nchunk_size = [128, 256]\n", name="small")
    args = ["sweep", str(path), "--out", str(tmp_path / "runs"), "--no-progress"]
    assert kvtb([*args, "--set", "requests=4", "--set", "workload=rag"]) == 0
    index = load_index(tmp_path / "runs" / "small")
    assert set(index["requests"]) == {4} and set(index["workload"]) == {"rag"}
