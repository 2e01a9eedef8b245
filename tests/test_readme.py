"""The README and the pages in ``docs/`` work as written, from any directory: every command
and snippet in them runs, and what the README says the demo shows is what the demo shows.

Every fenced ``bash`` or ``python`` block of README.md and docs/*.md is marked in its info
string: ``run`` blocks run here, README first, then the pages in name order, in one scratch
directory outside the checkout (nothing of the checkout linked into it: shipped sweeps by name,
the data directory as ``KVTB_DATA_DIR``, this environment's commands first on ``PATH``);
``show`` blocks are shown only (they need a GPU, a service, a checkout, or are long-running),
and a block with neither mark fails the test, so no command is left out silently. Every ``kvtb``
command of a ``show`` block that has no placeholder (``<run_id>``, ``...``, ``[--jobs 2]``) is
still parsed by ``kvtb``'s own parser, and no command names a path inside the checkout.

Sizes are made small in one documented way (:data:`SMALL`): ``--requests N`` above 8 becomes
``--requests 8`` (``none``: all of a trace, becomes 8 too), as does ``--set requests=N``; a
``kvtb run`` without ``--requests`` gets ``--requests 8``; more than 2 ``--instances`` become 2;
and ``kvtb sweep NAME`` gets ``--set requests=8`` and the keys of :data:`SMALL_GRIDS` that
collapse its grid to a few runs. ``kvtb demo`` runs at its real size: its headline, run id
included, is checked against the README's first result. A line ending in ``\\`` continues on
the next one.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
DATA = REPO.parent / "shared" / "data"
SMALL_REQUESTS = 8
SMALL_GRIDS = {
    "tp_mla": "--set tp=2",
    "chunk_size": "--set engine=oracle --set chunk_size=256",
    "fleet_routers": "--set router=kv_precise --set instances=2 --set capacity_tokens=4000",
}
"""Run keys set in every run of a shipped sweep the docs run, which collapse its grid (runs of
one resolved spec are one run) to two runs."""
SMALL_INSTANCES = 2
SMALL: tuple[tuple[re.Pattern[str], Any], ...] = (
    (re.compile(r"--requests (none|\d{2,})"), f"--requests {SMALL_REQUESTS}"),
    (re.compile(r"--set requests=\d{2,}"), f"--set requests={SMALL_REQUESTS}"),
    (re.compile(r"--instances ([3-9]|\d{2,})\b"), f"--instances {SMALL_INSTANCES}"),
    (
        re.compile(r"^(kvtb run (?!.*--requests ).*?)(\s*$|\s*&&)"),
        rf"\1 --requests {SMALL_REQUESTS}\2",
    ),
    (
        re.compile(r"^kvtb sweep (\S+)"),
        lambda m: " ".join(
            (m.group(0), f"--set requests={SMALL_REQUESTS}", SMALL_GRIDS.get(m.group(1), ""))
        ).rstrip(),
    ),
)
"""(pattern, replacement) applied to each command line of a ``run`` block, in order."""
PLACEHOLDER = re.compile(r"<\w+>|\.\.\.|\[--|\bREQUEST_ID\b")
"""What marks a command as a template (shown, not parsed)."""
CHECKOUT_PATHS = re.compile(r"(?<![\w/])(experiments/\S*\.toml|\.\./\S*)")
"""Paths that only exist relative to a checkout (a shipped sweep goes by its name)."""
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
    """A directory outside the checkout to run the docs in, and its environment."""
    work = tmp_path_factory.mktemp("readme")
    assert not work.resolve().is_relative_to(REPO)
    env = {
        **os.environ,
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
        "KVTB_DATA_DIR": str(DATA),
    }
    return work, env


def test_every_block_of_the_readme_and_the_docs_is_marked_run_or_show():
    assert blocks(README), "the README has no code block"
    found = [block for path in (README, *DOCS) for block in blocks(path)]
    unmarked = [block.where for block in found if block.mark is None]
    assert not unmarked, f"mark these blocks `run` or `show` (tests/test_readme.py): {unmarked}"
    assert {b.page for b in found if b.mark == "run"} >= {"README.md", "agentic.md", "runs.md"}


def kvtb_commands(block: Block) -> list[list[str]]:
    """The ``kvtb`` commands of a bash block without placeholders, as argument lists (after
    ``kvtb``; ``VAR=value`` prefixes and ``&&`` chains split off)."""
    found = []
    for line in commands(block):
        if not re.search(r"(^|[\s/])kvtb\s", line):
            continue
        for part in line.split("&&"):
            words = shlex.split(part, comments=True)
            while words and "=" in words[0] and not words[0].startswith("-"):
                words = words[1:]
            if words and Path(words[0]).name == "kvtb" and not PLACEHOLDER.search(part):
                found.append(words[1:])
    return found


def test_no_command_names_a_path_inside_the_checkout():
    found = [block for path in (README, *DOCS) for block in blocks(path)]
    bad = [
        f"{block.where}: {line}"
        for block in found
        if block.language == "bash"
        for line in commands(block)
        if "kvtb" in line and CHECKOUT_PATHS.search(line)
    ]
    assert not bad, "give shipped sweeps by name and data through $KVTB_DATA_DIR: " + str(bad)


def test_every_shown_kvtb_command_is_one_kvtb_accepts(capsys):
    from testbed.cli.kvtb import build_parser
    from testbed.sweep.experiments import resolve_sweep_file

    shown = [b for path in (README, *DOCS) for b in blocks(path) if b.language == "bash"]
    checked = 0
    for block in shown:
        for argv in kvtb_commands(block):
            try:
                args = build_parser().parse_args(argv)
            except SystemExit:
                pytest.fail(f"{block.where}: kvtb {shlex.join(argv)}\n{capsys.readouterr().err}")
            if args.command == "sweep":
                resolve_sweep_file(args.file)  # a shipped sweep, found from anywhere
            checked += 1
    assert checked > 20


RUNS_BLOCKS = pytest.mark.skipif(
    not DATA.is_dir(), reason="needs the data directory ../shared/data"
)
PAGES = [path.name for path in DOCS if any(block.mark == "run" for block in blocks(path))]
"""The pages of docs/ with blocks to run, each its own test (after the README's, whose runs
some of them read: the module's tests share one scratch directory and run in order)."""


@pytest.mark.vllm
@pytest.mark.slow  # 5 minutes on a loaded 2-core machine, the demo among them
@RUNS_BLOCKS
def test_the_readme_runs_and_its_first_result_is_the_demos(scratch):
    pytest.importorskip("vllm")
    work, env = scratch
    printed = run_blocks(README, work, env)
    # The demo ran at its real size: the README quotes its headline, and the external cache
    # serves at least 30% of the prompt tokens in it.
    headline = re.search(r"^In run \w+ \((.*)$", printed, re.M)
    assert headline, printed[-2000:]
    quoted = re.sub(r"^> ?", "", README.read_text(), flags=re.M)  # a quote's line markers
    assert headline.group(0) in " ".join(quoted.split()).replace("`", "")  # run id included
    external = int(re.search(r"external cache served (\d+)%", headline.group(0)).group(1))
    assert external >= 30
    report = (work / "runs" / "quickstart" / "report" / "report.md").read_text()
    figures = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", report)
    assert figures[0] == "whatif_hit_rate.png"  # the report opens with what the cache buys


@pytest.mark.vllm
@pytest.mark.slow  # up to 5 minutes a page on a loaded 2-core machine
@RUNS_BLOCKS
@pytest.mark.parametrize("page", PAGES)
def test_each_page_of_the_docs_runs_as_written_from_outside_the_checkout(scratch, page):
    pytest.importorskip("vllm")
    work, env = scratch
    run_blocks(REPO / "docs" / page, work, env)


def run_blocks(path: Path, work: Path, env: dict[str, str]) -> str:
    """Runs the ``run`` blocks of page ``path`` in ``work``, failing on the first command that
    fails; what the bash commands printed."""
    printed = ""
    for block in blocks(path):
        if block.mark != "run":
            continue
        if block.language == "python":
            done = _run([sys.executable, "-c", block.text], work, env)
            assert done.returncode == 0, f"{block.where}:\n{done.stdout}{done.stderr}"
            continue
        for command in commands(block):
            done = _run(["bash", "-c", command], work, env)
            assert done.returncode == 0, f"{block.where}: {command}\n{done.stdout}{done.stderr}"
            printed += done.stdout
    return printed


def _run(argv: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)  # fmt: skip


def test_small_sizes_are_substituted_as_documented():
    block = Block("README.md", 1, "bash", "run", (
        "kvtb demo   # the demo\n"
        "kvtb sweep tp_mla\n"
        "kvtb sweep workloads --jobs 2 && kvtb report runs/workloads\n"
        "kvtb run --workload chat --requests 200 \\\n    --out runs/mine\n"
        "kvtb run --engine fleet --instances 4 --out runs/fleet   # no --requests\n"
        "kvtb sweep chunk_size --set requests=20\n"
        "kvtb whatif chat --requests none --out w\n"
    ))  # fmt: skip
    assert commands(block) == [
        "kvtb demo",
        f"kvtb sweep tp_mla --set requests={SMALL_REQUESTS} {SMALL_GRIDS['tp_mla']}",
        f"kvtb sweep workloads --set requests={SMALL_REQUESTS} --jobs 2"
        " && kvtb report runs/workloads",
        f"kvtb run --workload chat --requests {SMALL_REQUESTS} --out runs/mine",
        f"kvtb run --engine fleet --instances 2 --out runs/fleet --requests {SMALL_REQUESTS}",
        f"kvtb sweep chunk_size --set requests={SMALL_REQUESTS} {SMALL_GRIDS['chunk_size']}"
        f" --set requests={SMALL_REQUESTS}",
        f"kvtb whatif chat --requests {SMALL_REQUESTS} --out w",
    ]
    assert shlex.split(commands(block)[2])[0] == "kvtb"
