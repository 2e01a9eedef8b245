"""The engines a run can drive, by name (``RunSpec.engine``): one entry per name of
:data:`testbed.spec.engines.ENGINE_NAMES`.

Adding an engine: its name and its rules in :mod:`testbed.spec.engines`, and its run glue in
the module of this package named for it, ``testbed/run/<name>.py``, whose ``ENTRY`` is its
:class:`~testbed.run.interface.EngineEntry` (a ``run(EngineRun) -> EngineResult`` and, where it
needs them, checks).
"""

from __future__ import annotations

from importlib import import_module

from testbed.run.interface import EngineEntry
from testbed.spec.engines import ENGINE_NAMES


def _entry(name: str) -> EngineEntry:
    entry = import_module(f"testbed.run.{name}").ENTRY
    if not isinstance(entry, EngineEntry):
        raise TypeError(f"testbed.run.{name}.ENTRY is not an EngineEntry")
    return entry


ENGINES: dict[str, EngineEntry] = {name: _entry(name) for name in ENGINE_NAMES}
