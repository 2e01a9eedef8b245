"""Files a server leaves behind when it cannot clean up (SIGKILL, power loss), and reclaiming them.

A server's pool (``kvtb-pool-<pid>-<hex>``, up to its capacity of RAM in ``/dev/shm``), its
default token file (``kvtb-token-<pid>-<hex>.json``) and a worker's shared KV file
(``kvtb-kv-<pid>-<hex>``, server-driven transfers) are each removed on every exit their owner
can catch. Their owner holds an advisory lock on each for its lifetime
(``testbed.core.owned_files``); a server start (and ``kvtb clean``) removes those whose lock is
free:
their owner is gone, whatever PID namespace it ran in (the pid in the name is only a label: a
container sharing ``/dev/shm`` has pids of its own). Files of live owners, and of other
users, are left alone; so are files of earlier versions (8 hex digits: their owners held no
lock) while their pid runs here.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from testbed.core.owned_files import OWNED_HEX_DIGITS, owned_name, remove_if_abandoned

SERVER_FILE = re.compile(r"kvtb-(?:pool|token|kv)-(\d+)-([0-9a-f]+)(?:\.json)?")
"""Names of the files servers and workers own: the owner's pid (a label), a random part."""


def server_files_dir() -> Path:
    """Where servers keep their pool and token files: ``/dev/shm`` if it exists."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


def default_token_path() -> Path:
    return server_files_dir() / owned_name("kvtb-token-", ".json")


def reclaim_dead_server_files(directories: list[Path] | None = None) -> list[Path]:
    """Removes the pool, token and shared KV files whose owner is gone; returns them."""
    removed = []
    for directory in directories or [server_files_dir(), Path(tempfile.gettempdir())]:
        if not directory.is_dir():
            continue
        for path in sorted(directory.iterdir()):
            match = SERVER_FILE.fullmatch(path.name)
            if match is None:
                continue
            legacy = None if len(match.group(2)) == OWNED_HEX_DIGITS else int(match.group(1))
            if remove_if_abandoned(path, legacy_pid=legacy):
                removed.append(path)
    return removed
