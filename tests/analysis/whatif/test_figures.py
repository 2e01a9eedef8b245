"""What-if figures, alone and in ``kvtb report`` of a sweep over capacity and policy."""

from __future__ import annotations

import subprocess
import sys

import matplotlib

matplotlib.use("Agg")

import pytest

from testbed.analysis.whatif import WhatIfOptions, what_if_workload  # noqa: E402
from testbed.analysis.whatif.figures import whatif_figures  # noqa: E402
from testbed.spec.runspec import RunSpec  # noqa: E402

SWEEP = """
name = "capacity_whatif"
[base]
engine = "oracle"
workload = "rag"
requests = 40
chunk_size = 64
workload_params = { num_documents = 15, document_tokens = [32, 256] }
[grid]
capacity_tokens = [1024, 4096]
policy = ["lru", "belady"]
"""


def test_whatif_figures_draw_curves_points_and_distributions():
    run = RunSpec(workload="chat", requests=40)
    whatif = what_if_workload(run, WhatIfOptions(chunk_sizes=(64, 256), policy_points=2))
    figures = whatif_figures(whatif, context="chat")
    assert [name for name, _, _ in figures] == [
        "whatif_hit_rate.png", "whatif_min_capacity.png", "whatif_reuse.png"
    ]  # fmt: skip
    hit_rate = figures[0][1].axes[0]
    labels = {line.get_label() for line in hit_rate.get_lines()}
    assert {"LRU, chunk 64", "LRU, chunk 256", "belady, chunk 64"} <= labels


@pytest.mark.slow
def test_a_capacity_sweeps_report_carries_the_whatif_figures(tmp_path):
    sweep = tmp_path / "sweep.toml"
    sweep.write_text(SWEEP)
    for args in (["sweep", str(sweep), "--out", str(tmp_path), "--no-progress"],
                 ["report", str(tmp_path / "capacity_whatif")]):  # fmt: skip
        done = subprocess.run([sys.executable, "-m", "testbed.cli", *args], capture_output=True,
                              text=True, timeout=300, stdin=subprocess.DEVNULL)  # fmt: skip
        assert done.returncode == 0, done.stderr
    report = tmp_path / "capacity_whatif" / "report"
    assert (report / "whatif_hit_rate.png").is_file()
    assert "whatif_min_capacity.png" in (report / "report.md").read_text()
