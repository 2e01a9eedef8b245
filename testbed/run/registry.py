"""The engines a run can drive, by name (``RunSpec.engine``).

Adding an engine: its run glue in a module of this package (a ``run(EngineRun) ->
EngineResult`` and, where it needs them, checks; see :class:`~testbed.run.interface.EngineEntry`)
and one line here.
"""

from __future__ import annotations

from testbed.run import fleet, oracle, replay, serve, vllm
from testbed.run.interface import EngineEntry

ENGINES: dict[str, EngineEntry] = {
    "replay": replay.ENTRY,
    "fleet": fleet.ENTRY,
    "vllm": vllm.ENTRY,
    "serve": serve.ENTRY,
    "oracle": oracle.ENTRY,
}
