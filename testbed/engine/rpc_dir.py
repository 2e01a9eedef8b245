"""A private directory for vLLM's ZeroMQ IPC sockets.

vLLM names the sockets between its API server, engine core and workers
``ipc://$VLLM_RPC_BASE_PATH/<uuid>`` (default: the machine's temp directory) and does not remove
them when its processes are stopped: every server started and stopped leaves a handful of
socket files there. A server kvtb launches gets a directory of its own instead,
``kvtb-vllm-rpc-<pid>-<hex>`` in the temp directory (named as :func:`owned_name` names a
process's files, so a leak check can tell whose it is), removed with its sockets when the
server has stopped.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from testbed.core.owned_files import owned_name

RPC_BASE_ENV = "VLLM_RPC_BASE_PATH"
PREFIX = "kvtb-vllm-rpc-"


class RpcDir:
    """Made on construction (mode 0700); :meth:`remove` deletes it and what is in it."""

    def __init__(self) -> None:
        self.path = Path(tempfile.gettempdir()) / owned_name(PREFIX)
        self.path.mkdir(mode=0o700)

    def env(self) -> dict[str, str]:
        """The variable that puts vLLM's sockets here."""
        return {RPC_BASE_ENV: str(self.path)}

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
