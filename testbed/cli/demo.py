"""``kvtb demo``: the main job on this machine, the quickstart sweep, then its report and its
headline (what the external cache served in the headline run).

Runs in the ``kvtb`` process: it sits above the sweep and the report, which it uses in turn.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from testbed.analysis.headline import headline
from testbed.analysis.source import open_source
from testbed.report.sweep_report import write_report
from testbed.sweep.cli import SweepOptions, print_result, run_sweep
from testbed.sweep.experiments import experiment_path
from testbed.sweep.spec import load_sweep

QUICKSTART = experiment_path("quickstart")
"""The demo's sweep, shipped with the package."""
DEMO_JOBS = 1
"""Runs at once: on two cores a replay run already keeps two processes (engine, server) busy."""


def demo(out_dir: Path, overrides: Mapping[str, Any] | None = None) -> int:
    """Runs the quickstart sweep into ``out_dir`` (``overrides``: ``--set``), writes its report
    and prints its headline; 1 if a run failed."""
    sweep = load_sweep(QUICKSTART, overrides=overrides)
    result = run_sweep(sweep, out_dir, SweepOptions(jobs=DEMO_JOBS))
    print_result(sweep, result)
    if result.failed:
        return 1
    print(f"report: {write_report(result.sweep_dir)}")
    sentence = headline(open_source(result.sweep_dir).runs)
    if sentence:
        print(sentence.replace("`", ""))
    return 0
