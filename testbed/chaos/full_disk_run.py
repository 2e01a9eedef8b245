"""A run whose disk fills up mid-run: run inside a private mount namespace.

``python -m testbed.chaos.full_disk_run OUT --requests N [--fill-at K]`` runs a small replay
(its own cache server) into ``OUT``, a small tmpfs of a private mount namespace
(``testbed.chaos.mounts``; ``kvtb chaos``'s ``disk_full`` and the tests start it so), and fills
that file system to the last byte once ``K`` requests have finished, as another process
would. Each engine step lasts at least ``--step-s`` (a forward pass), so the run goes on long
after the disk is full. The run must still serve every request and end with a summary saying
what it could not record; the summary is printed as one JSON line.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from testbed.chaos.mounts import fill
from testbed.chaos.runs import pace_steps
from testbed.run import RunOptions, execute_run
from testbed.spec.runspec import RunSpec


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.chaos.full_disk_run")
    parser.add_argument("out", type=Path)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--fill-at", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1.0)
    parser.add_argument(
        "--step-s", type=float, default=0.05, help="least wall time of an engine step"
    )
    args = parser.parse_args(argv)
    pace_steps(args.step_s)  # as a forward pass: the run outlasts the server's flushes
    spec = RunSpec(
        workload="chat",
        requests=args.requests,
        chunk_size=64,
        engine_blocks=48,
        server_timeout_s=args.timeout,
        max_output_tokens=2,
    )

    def progress(done: int, total: int) -> None:
        if done == args.fill_at:
            fill(args.out)  # the disk under the run directory fills up

    summary = execute_run(spec, args.out, RunOptions(progress=False, on_progress=progress))
    print(json.dumps(summary, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
