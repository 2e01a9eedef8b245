"""``kvtb explain DIR REQUEST_ID [--run RUN]``: why one request hit or missed, printed.

``DIR`` is a run directory, or a sweep (or a directory of runs): then the request is explained
in each of its measured runs, each story headed by the run's id and label, or in the one run
``--run`` names (id or label). ``REQUEST_ID`` is vLLM's request id (the connector's), the
workload's (the engine's request span), the session id, or the id a client of vLLM's OpenAI
server saw (``cmpl-...``). The story comes from :mod:`testbed.analysis.explain`: the request's
lookup, where each of its prompt tokens went (the attribution's categories), and its first miss
with its cause (for a capacity miss the evict span and the request that stored the chunk).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from testbed.spec.paths import absolute_path


def add_explain_parser(commands: Any) -> None:
    """Adds ``explain`` to ``kvtb``'s subcommands (``commands``: argparse's subparsers)."""
    explain = commands.add_parser("explain", help="why one request of a run hit or missed")
    explain.add_argument(
        "run_dir", type=absolute_path, metavar="DIR", help="a run directory or a sweep"
    )
    explain.add_argument(
        "request_id",
        metavar="REQUEST_ID",
        help="vLLM's, the workload's, the session id, or the id a client saw (cmpl-...)",
    )
    explain.add_argument(
        "--run", metavar="RUN", help="in a sweep: the run to explain it in (its id or label)"
    )


def run_explain(args: argparse.Namespace) -> int:
    """Prints the story (in each run of a sweep); 2 when the request or run is not found."""
    from testbed.analysis.explain_runs import explain_runs
    from testbed.analysis.spans import is_run_dir

    try:
        if is_run_dir(args.run_dir) and args.run is None:
            from testbed.analysis.explain import explain

            print(explain(args.run_dir, args.request_id))
        else:
            print(explain_runs(args.run_dir, args.request_id, args.run))
    except LookupError as exc:
        print(f"kvtb explain: {exc.args[0]}", file=sys.stderr)
        return 2
    return 0
