"""``kvtb whatif`` end to end on a workload, against ``kvtb run --engine oracle``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from testbed.analysis.whatif import load_whatif
from testbed.cli.kvtb import main

WORKLOAD = ["--workload-param", "num_documents=20", "--workload-param", "document_tokens=[32, 256]"]


def kvtb(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "testbed.cli", *args],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def test_whatif_of_a_workload_equals_the_oracle_runs_it_replaces(tmp_path):
    done = kvtb("whatif", "rag", "--requests", "60", *WORKLOAD, "--chunk-sizes", "64,128",
                "--at", "2048,8192", "--policies", "lru,belady", "--policy-points", "2",
                "--figures", "--out", str(tmp_path / "w"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    whatif = load_whatif(tmp_path / "w")
    # A workload's hits are all the external cache's: the line says so, with the curve's rate.
    rate = whatif.point(64, None)["token_hit_rate"]
    assert f"chunk 64, unlimited cache: external hit rate {rate:.2%}; 90% of them" in done.stdout
    assert {p.name for p in (tmp_path / "w").glob("*.png")} == {
        "whatif_hit_rate.png", "whatif_min_capacity.png", "whatif_reuse.png"
    }  # fmt: skip
    for policy, capacity in (("lru", "2048"), ("belady", "8192"), ("lru", "unlimited")):
        ran = main(["run", "--engine", "oracle", "--workload", "rag", "--requests", "60",
                    *WORKLOAD, "--chunk-size", "64", "--policy", policy,
                    "--capacity-tokens", capacity, "--out", str(tmp_path / "runs"),
                    "--no-progress"])  # fmt: skip
        assert ran == 0, (policy, capacity)
        (summary,) = [
            json.loads(p.read_text())
            for p in (tmp_path / "runs").glob("*/summary.json")
            if json.loads((p.parent / "spec.json").read_text())["policy"] == policy
            and str(json.loads((p.parent / "spec.json").read_text())["capacity_tokens"] or
                    "unlimited") == capacity
        ]  # fmt: skip
        point = whatif.point(64, None if capacity == "unlimited" else int(capacity), policy)
        assert point["token_hit_rate"] == summary["token_hit_rate"], (policy, capacity)
        assert abs(point["mean_request_hit_rate"] - summary["mean_request_hit_rate"]) < 1e-12


def test_bad_whatif_arguments_are_refused_before_any_work(tmp_path, capsys):
    out = ["--out", str(tmp_path / "w")]
    assert main(["whatif", *out]) == 2
    assert "name a SOURCE" in capsys.readouterr().err
    assert main(["whatif", "chat", "--policies", "lru,mru", *out]) == 2
    assert "policies must be some of" in capsys.readouterr().err
    assert main(["whatif", "chat", "--at", "lots", *out]) == 2
    assert "--at expects comma-separated integers" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


@pytest.mark.slow
def test_whatif_tiers_writes_every_capacity_pair_and_labels_the_simulated_policies(tmp_path):
    done = kvtb("whatif", "rag", "--requests", "60", *WORKLOAD, "--chunk-sizes", "64",
                "--tiers", "--l1", "1024,4096", "--l2", "4096,16384",
                "--tier-policies", "write_through+retain,write_back+none",
                "--figures", "--out", str(tmp_path / "w"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    tiers = load_whatif(tmp_path / "w").tiers
    assert tiers is not None and len(tiers) == 2 * 2 * 2
    methods = tiers.groupby("tier_write")["method"].unique().map(list).to_dict()
    assert methods == {"write_through": ["one_pass"], "write_back": ["simulated"]}
    assert (tiers["hit_tokens"] == tiers["host_hit_tokens"] + tiers["disk_hit_tokens"]).all()
    assert "tiers (simulated, write_back+none)" in done.stdout
    assert (tmp_path / "w" / "whatif_tiers.png").is_file()
    bad = kvtb("whatif", "rag", "--requests", "5", "--tiers", "--tier-policies", "write_back",
               "--out", str(tmp_path / "x"))  # fmt: skip
    assert bad.returncode != 0 and "TIER_WRITE+TIER_PROMOTE" in bad.stderr
