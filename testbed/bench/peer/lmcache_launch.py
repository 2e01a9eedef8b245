"""Starting the real LMCache multi-process server and vLLM engines with LMCache's connector.

The server runs ``lmcache.v1.multiprocess.server`` from the peer environment on a free
loopback port with ``--supported-transfer-mode auto`` (both transfer modes) and usage
tracking off, its L1 pool in a shared-memory file whose name we choose (so the worker-copies
mode maps it instead of pickling KV over ZeroMQ). Ready when it logs that it is running.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

from testbed.bench.peer.env import PeerEnv
from testbed.bench.processes import SHM, BenchProcesses

READY_TEXT = "cache server is running"
CHILD = Path(__file__).resolve().parent / "lmcache_child.py"
MODES = {"LMCache engine_driven": "engine_driven", "LMCache lmcache_driven": "lmcache_driven"}
"""Our names for LMCache's two transfer modes (the worker copies; the server copies)."""
ENV = {"LMCACHE_TRACK_USAGE": "false", "PYTHONHASHSEED": "0"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_server(
    processes: BenchProcesses,
    env: PeerEnv,
    log_path: Path,
    *,
    chunk_size: int,
    l1_gib: float,
    timeout_s: float = 300.0,
) -> int:
    """Starts an LMCache server; its port once it is ready (``RuntimeError`` if it never is)."""
    port = free_port()
    shm_name = f"kvtb-bench-lmcache-{os.getpid()}-{port}"
    processes.shm_files.add(SHM / f"lmcache_l1_pool_{shm_name}")
    command = [
        str(env.python),
        "-m",
        "lmcache.v1.multiprocess.server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--chunk-size",
        str(chunk_size),
        "--supported-transfer-mode",
        "auto",
        "--l1-size-gb",
        str(l1_gib),
        "--no-l1-use-lazy",
        "--eviction-policy",
        "LRU",
        "--shm-name",
        shm_name,
        "--disable-metrics",  # Prometheus would bind 0.0.0.0:9090
    ]
    process = processes.start(command, log_path, ENV)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if READY_TEXT in log_path.read_text(errors="replace"):
            processes.note_shm_files()
            return port
        if process.poll() is not None:
            break
        time.sleep(0.5)
    raise RuntimeError(f"the LMCache server did not start (its log: {log_path})")


def start_engine(
    processes: BenchProcesses,
    env: PeerEnv,
    log_path: Path,
    *,
    model_dir: Path,
    max_len: int,
    port: int,
    mode: str,
    kv_bytes_per_token: int,
    vocab: int,
) -> subprocess.Popen[str]:
    """A vLLM engine with LMCache's connector in ``mode`` (``engine_driven``/``lmcache_driven``),
    speaking the engine protocol on its stdin/stdout."""
    command = [
        str(env.python),
        str(CHILD),
        "--model",
        str(model_dir),
        "--max-len",
        str(max_len),
        "--port",
        str(port),
        "--mode",
        mode,
        "--kv-bytes-per-token",
        str(kv_bytes_per_token),
        "--vocab",
        str(vocab),
    ]
    return processes.start(command, log_path, ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
