"""A client of a server whose ``/dev/shm`` another process fills: run inside a small private one.

``python -m testbed.chaos.shm_probe --pool-mib N --chunks M`` runs in a private mount
namespace whose ``/dev/shm`` is a small tmpfs (``testbed.chaos.mounts``; ``kvtb chaos``'s
``shm_exhaustion`` and the tests start it so). It starts a server whose pool fits (not mapped
in ahead: ``--prefault 0``), fills ``/dev/shm`` to the last byte as another process would,
then stores ``M`` chunks through the pool and reads them back, every byte checked; then it
starts a second server, whose pool can no longer fit. It prints one JSON line: ``errors``
(chunks missing or wrong), ``stored_bytes``, ``requests`` (probe requests answered),
``refusal`` (the second server's exit code and message). A pool whose pages were not there
would kill this process with ``SIGBUS`` instead.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path

from server.launch import ServerProcess, ServerStartError
from testbed.chaos.mounts import fill
from testbed.chaos.probes import ProbeClient

SHM = Path("/dev/shm")
CHUNKS_PER_CYCLE = 512


def _second_server() -> dict[str, object]:
    """Starts a server whose pool cannot fit now: its exit code and last line."""
    with tempfile.TemporaryDirectory() as directory:
        try:
            tokens = ["--token-file", f"{directory}/tokens.json"]  # not in the full /dev/shm
            log = Path(directory) / "log"
            ServerProcess(["--capacity", "8MiB", *tokens], log_path=log).start().close()
        except ServerStartError as exc:
            code = 2 if "exited with code 2" in str(exc) else 1
            return {"exit_code": code, "message": str(exc).splitlines()[-1]}
    return {"exit_code": 0, "message": "started: not refused"}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.chaos.shm_probe")
    parser.add_argument("--pool-mib", type=int, required=True)
    parser.add_argument("--chunks", type=int, required=True, help="64 tokens of 128 B each")
    args = parser.parse_args(argv)
    pool = ["--chunk-size", "64", "--capacity", f"{args.pool_mib}MiB", "--prefault", "0"]
    errors = requests = 0
    with ServerProcess(pool) as server:
        fill(SHM)  # another process takes every page left
        with ProbeClient(server.url, server.token) as client:
            client.register()
            for start in range(0, args.chunks, CHUNKS_PER_CYCLE):
                count = min(CHUNKS_PER_CYCLE, args.chunks - start)
                errors += client.cycle(f"after-fill-{start}", num_chunks=count)
                requests += 5  # store begin and commit, lookup, retrieve begin and end
            stored = client.stats().stored_bytes
        refusal = _second_server()
    print(
        json.dumps(
            {"errors": errors, "stored_bytes": stored, "requests": requests, "refusal": refusal}
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
