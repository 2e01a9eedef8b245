"""What-if from one pass: hit rate at every capacity, chunk size and policy without re-running.

Modules (all run in the analysing process; nothing here talks to a server or an engine):

- :class:`AccessTrace` (:mod:`testbed.models.access_trace`): the access stream (lookups and
  references) at one chunk size, and its exact re-chunking to multiples of that size;
- :mod:`.sources`: traces of a workload, keyed as the oracle keys it (Mooncake traces straight
  from their ``hash_ids``);
- :mod:`.runlog`: the trace a run recorded (chunk event log + request accounting);
- :mod:`.stack`: Mattson's stack algorithm with prefix semantics (numba), optionally sampled;
- :mod:`.curves`: LRU hit curves, their points, the minimum-capacity gauge;
- Belady, FIFO and LFU points: the oracle's simulated cache (:mod:`testbed.models.cache_sim`)
  at sampled capacities;
- :mod:`.reuse`: reuse distance and interval distributions per workload group;
- :mod:`.analyze`: one what-if over a source; :mod:`.results`: ``whatif.json`` and Parquet;
- :mod:`.figures`: the figures (also added to ``kvtb report``).

METRICS.md (section "What-if") defines every number.
"""

from testbed.analysis.whatif.analyze import (
    WhatIfOptions,
    analyze,
    what_if_run,
    what_if_workload,
)
from testbed.analysis.whatif.curves import LRUCurve, Point, lru_curve
from testbed.analysis.whatif.results import WhatIf, load_whatif, write_whatif
from testbed.analysis.whatif.stack import stack_distances
from testbed.models.access_trace import AccessTrace

__all__ = [
    "AccessTrace",
    "LRUCurve",
    "Point",
    "WhatIf",
    "WhatIfOptions",
    "analyze",
    "load_whatif",
    "lru_curve",
    "stack_distances",
    "what_if_run",
    "what_if_workload",
    "write_whatif",
]
