"""The README works as written: every command and snippet in it runs, and what it says the demo
shows is what the demo shows.

Every fenced ``bash`` or ``python`` block of README.md is marked in its info string: ``run``
blocks run here, in the README's order, in one scratch directory (``experiments/`` and
``notebooks/`` linked from the checkout, the data directory as ``KVTB_DATA_DIR``, this
environment's commands first on ``PATH``); ``show`` blocks are shown only (they need a GPU, a
service, or are the test suite itself), and a block with neither mark fails the test, so no
command is left out silently. Pages in ``docs/`` run their ``run`` blocks the same way (after
the README's, in the same directory); their unmarked blocks are shown only.

Sizes are made small in one documented way (:data:`SMALL`): ``make demo`` runs as ``kvtb demo``
at its real size (its headline is checked against the README's first result), ``--requests N``
above 8 becomes ``--requests 8`` (``none``: all of a trace, becomes 8 too), and ``kvtb sweep``
gets ``--set requests=8``. A line ending in ``\\`` continues on the next one.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
DATA = REPO.parent / "shared" / "data"
SMALL_REQUESTS = 8
SMALL = (
    (re.compile(r"^make demo\b"), "kvtb demo"),
    (re.compile(r"--requests (none|\d{2,})"), f"--requests {SMALL_REQUESTS}"),
    (re.compile(r"^(kvtb sweep \S+)"), rf"\1 --set requests={SMALL_REQUESTS}"),
)
"""(pattern, replacement) applied to each command line of a ``run`` block, in order."""
FENCE = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```", re.M | re.S)
MARKS = ("run", "show")


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    language: str
    mark: str | None
    text: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced bash and python blocks of a Markdown page."""
    text = path.read_text()
    found = []
    for match in FENCE.finditer(text):
        language, info, body = match.group(1), match.group(2).split(), match.group(3)
        if language not in ("bash", "python"):
            continue
        mark = next((word for word in info if word in MARKS), None)
        line = text.count("\n", 0, match.start()) + 1
        found.append(Block(path.name, line, language, mark, body))
    return found


def commands(block: Block) -> list[str]:
    """The commands of a bash block (comments dropped, continued lines joined), made small."""
    joined = block.text.replace("\\\n", " ")
    lines = [" ".join(line.split("  #")[0].split()) for line in joined.splitlines()]
    result = []
    for line in lines:
        if not line or line.startswith("#"):
            continue
        for pattern, replacement in SMALL:
            line = pattern.sub(replacement, line)
        result.append(line)
    return result


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A directory to run the README in, and its environment."""
    work = tmp_path_factory.mktemp("readme")
    for name in ("experiments", "notebooks"):
        (work / name).symlink_to(REPO / name)
    env = {
        **os.environ,
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
        "KVTB_DATA_DIR": str(DATA),
    }
    return work, env


def test_every_block_of_the_readme_is_marked_run_or_show():
    found = blocks(README)
    assert found, "the README has no code block"
    unmarked = [block.where for block in found if block.mark is None]
    assert not unmarked, f"mark these blocks `run` or `show` (tests/test_readme.py): {unmarked}"
    assert any(block.mark == "run" for block in found)


@pytest.mark.vllm
@pytest.mark.skipif(not DATA.is_dir(), reason="needs the data directory ../shared/data")
@pytest.mark.slow
def test_the_readme_runs_and_its_first_result_is_the_demos(scratch):
    pytest.importorskip("vllm")
    work, env = scratch
    runnable = [b for path in (README, *DOCS) for b in blocks(path) if b.mark == "run"]
    printed = ""
    for block in runnable:
        if block.language == "python":
            done = _run([sys.executable, "-c", block.text], work, env)
            assert done.returncode == 0, f"{block.where}:\n{done.stdout}{done.stderr}"
            continue
        for command in commands(block):
            done = _run(["bash", "-c", command], work, env)
            assert done.returncode == 0, f"{block.where}: {command}\n{done.stdout}{done.stderr}"
            printed += done.stdout
    # The demo ran at its real size: the README quotes its headline, and the external cache
    # serves at least 30% of the prompt tokens in it.
    headline = re.search(r"^In run \w+ \((.*)$", printed, re.M)
    assert headline, printed[-2000:]
    quoted = re.sub(r"^> ?", "", README.read_text(), flags=re.M)  # a quote's line markers
    assert _unrun(headline.group(0)) in _unrun(" ".join(quoted.split()))
    external = int(re.search(r"external cache served (\d+)%", headline.group(0)).group(1))
    assert external >= 30
    report = (work / "runs" / "quickstart" / "report" / "report.md").read_text()
    figures = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", report)
    assert figures[0] == "whatif_hit_rate.png"  # the report opens with what the cache buys


def _unrun(text: str) -> str:
    """A headline without its run id (which moves whenever a spec field is added)."""
    return re.sub(r"run `?\w{12}`?", "run ID", text)


def _run(argv: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)  # fmt: skip


def test_small_sizes_are_substituted_as_documented():
    block = Block("README.md", 1, "bash", "run", (
        "make demo   # the demo\n"
        "kvtb sweep tp_mla\n"
        "kvtb run --workload chat --requests 200 \\\n    --out runs/mine\n"
        "kvtb whatif chat --requests none --out w\n"
    ))  # fmt: skip
    assert commands(block) == [
        "kvtb demo",
        f"kvtb sweep tp_mla --set requests={SMALL_REQUESTS}",
        f"kvtb run --workload chat --requests {SMALL_REQUESTS} --out runs/mine",
        f"kvtb whatif chat --requests {SMALL_REQUESTS} --out w",
    ]
    assert shlex.split(commands(block)[2])[0] == "kvtb"
