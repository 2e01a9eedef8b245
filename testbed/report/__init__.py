"""Reports over finished runs: a sweep's tables and figures (:mod:`~testbed.report.sweep_report`,
``kvtb report``) and a Jaeger-UI export of runs' spans (:mod:`~testbed.report.jaeger`,
``kvtb export jaeger``).

Runs in the ``kvtb`` process. Reads run directories through ``testbed.analysis``; never runs an
engine or a sweep.
"""
