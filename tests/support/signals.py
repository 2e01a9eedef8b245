"""Children a test interrupts as a terminal would (SIGINT).

A shell ignores SIGINT in the commands it starts in the background without job control
(``make test &``, ``nohup``), and what they start inherits that; Python then installs no
``KeyboardInterrupt`` handler, and a shell cannot trap a signal ignored when it started. A
test that sends SIGINT starts its child with :func:`default_sigint` as ``preexec_fn``, so that
the child gets SIGINT's default handling whatever the suite was started from.
"""

from __future__ import annotations

import signal


def default_sigint() -> None:
    """Runs in the child between fork and exec: SIGINT back to its default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
