"""``kvtb explain RUN REQUEST_ID``: why one request of a run hit or missed, printed.

``REQUEST_ID`` is vLLM's request id (the connector's), the workload's (the engine's request
span) or the session id. The story comes from :func:`testbed.analysis.explain.explain`: the
request's lookup, where each of its prompt tokens went, and its first miss with its cause (for
a capacity miss the evict span and the request that stored the chunk).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_explain_parser(commands: Any) -> None:
    """Adds ``explain`` to ``kvtb``'s subcommands (``commands``: argparse's subparsers)."""
    explain = commands.add_parser("explain", help="why one request of a run hit or missed")
    explain.add_argument("run_dir", type=Path, metavar="RUN", help="a run directory")
    explain.add_argument(
        "request_id", metavar="REQUEST_ID", help="vLLM's, the workload's or the session id"
    )


def run_explain(args: argparse.Namespace) -> int:
    """Prints the story; 2 when the run or the request is not found."""
    from testbed.analysis.explain import explain

    try:
        story = explain(args.run_dir, args.request_id)
    except LookupError as exc:
        print(f"kvtb explain: {exc.args[0]}", file=sys.stderr)
        return 2
    print(story)
    return 0
