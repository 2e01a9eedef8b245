"""Run orchestration: one :class:`~testbed.spec.runspec.RunSpec` → its engine → a run directory.

Runs in the ``kvtb run`` process (and in sweep and chaos children). Modules, each one job:

- :mod:`~testbed.run.execute`: :func:`execute_run` (reuse a finished run or make a new one)
- :mod:`~testbed.run.prepare`: every check before any work; :class:`~testbed.run.plan.RunPlan`
- :mod:`~testbed.run.interface`: what an engine is to a run (``EngineEntry``, ``EngineRun``)
- :mod:`~testbed.run.registry`: ``ENGINES[name]``; each engine's glue in its own module
  (:mod:`~testbed.run.replay`, :mod:`~testbed.run.fleet`, :mod:`~testbed.run.vllm`,
  :mod:`~testbed.run.serve`, :mod:`~testbed.run.oracle`)
- :mod:`~testbed.run.dispatch`: driving the engine against its cache servers
- :mod:`~testbed.run.servers`: the cache servers a run starts or is given
- :mod:`~testbed.run.record`: ``spec.json``, ``env.json``, resource attributes, ``summary.json``
- :mod:`~testbed.run.servable`: which requests an engine can serve
"""

from testbed.core.run_dir import ERROR, SPEC, SUMMARY
from testbed.run.execute import execute_run, failure, is_complete, is_reusable, reuse_differences
from testbed.run.footprint import pool_blocks
from testbed.run.options import RunOptions
from testbed.run.plan import RunPlan
from testbed.run.prepare import prepare_run
from testbed.run.record import environment
from testbed.run.servable import max_model_len, split_servable

__all__ = [
    "ERROR",
    "SPEC",
    "SUMMARY",
    "RunOptions",
    "RunPlan",
    "environment",
    "execute_run",
    "failure",
    "is_complete",
    "is_reusable",
    "max_model_len",
    "pool_blocks",
    "prepare_run",
    "reuse_differences",
    "split_servable",
]
