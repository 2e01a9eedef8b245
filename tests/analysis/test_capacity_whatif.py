"""The capacity what-if of a source: the workload's curve with the runs on it, or why not."""

from __future__ import annotations

from matplotlib import pyplot as plt

from testbed.analysis import capacity_whatif as cw
from testbed.analysis.source import open_source
from testbed.spec.runspec import RunSpec
from tests.analysis.run_dirs import write_run, write_sweep

BASE = {"workload": "chat", "requests": 12, "chunk_size": 64}


def test_a_sweep_of_one_workload_gets_its_curve_with_every_run_on_it(tmp_path):
    sweep = tmp_path / "capacity"
    unlimited = write_run(sweep, RunSpec(engine="oracle", **BASE), {"token_hit_rate": 0.7})
    limited = write_run(
        sweep, RunSpec(engine="oracle", capacity_tokens=512, **BASE), {"token_hit_rate": 0.2}
    )
    no_rate = write_run(sweep, RunSpec(engine="oracle", capacity_tokens=1024, **BASE), {})
    source = open_source(
        write_sweep(tmp_path, "capacity", ["capacity_tokens"], [unlimited, limited, no_rate])
    )
    result = cw.capacity_whatif(source)
    assert result.applies and result.kind == cw.WORKLOAD
    curve = result.whatif.lru[64]
    points = result.measured.set_index("label")
    assert list(points.index) == [
        "oracle capacity_tokens=unlimited",
        "oracle capacity_tokens=512",
    ]  # the run without a hit rate is no point
    assert points["capacity_tokens"].tolist() == [curve.num_distinct_keys * 64, 512]
    assert points["unlimited"].tolist() == [True, False]
    # The oracle runs' own arithmetic: the unlimited point lies on the curve's end.
    assert result.whatif.point(64, None)["token_hit_rate"] > 0
    assert result.residual().empty
    assert "chunk sizes 64" in result.describe()
    for draw in (cw.hit_rate_figure, cw.min_capacity_figure, cw.reuse_figure):
        plt.close(draw(result, "What-if"))


def test_runs_of_different_workloads_have_no_curve_and_say_why(tmp_path):
    sweep = tmp_path / "workloads"
    runs = [
        write_run(
            sweep, RunSpec(engine="oracle", **{**BASE, "workload": w}), {"token_hit_rate": 0.5}
        )
        for w in ("chat", "docqa")
    ]
    result = cw.capacity_whatif(open_source(write_sweep(tmp_path, "workloads", ["workload"], runs)))
    assert not result.applies and "differ in workload" in result.reason
    assert result.describe().startswith("No capacity what-if")
    figure = cw.hit_rate_figure(result, "What-if")
    assert any("differ in workload" in text.get_text() for text in figure.axes[0].texts)
    plt.close(figure)


def test_a_missing_trace_file_is_a_reason_not_an_error(tmp_path):
    spec = RunSpec(engine="oracle", **{**BASE, "workload": "mooncake:nowhere/trace.jsonl"})
    result = cw.capacity_whatif(open_source(write_run(tmp_path, spec, {"token_hit_rate": 0.5})))
    assert not result.applies and "nowhere" in result.reason
