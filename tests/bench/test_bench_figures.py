"""The pure parts of ``kvtb bench``: spreads, interleaving, ratios, goals, the report."""

from __future__ import annotations

import json

import pytest

from testbed.bench import report
from testbed.bench.figures import GOALS, PEER_GOALS, Figure, goal_of, merge
from testbed.bench.stats import Ratio, Spread, interleave


def test_a_spread_holds_the_order_statistics_of_its_samples():
    spread = Spread.of([5.0, 1.0, 4.0, 2.0, 3.0])
    assert (spread.n, spread.min, spread.median, spread.max) == (5, 1.0, 3.0, 5.0)
    assert (spread.q1, spread.q3) == (2.0, 4.0)
    with pytest.raises(ValueError):
        Spread.of([])


def test_cells_run_in_turn_within_each_round_and_warm_up_rounds_are_dropped():
    calls: list[str] = []

    def cell(name: str, seconds: float):
        def run() -> float:
            calls.append(name)
            return seconds

        return run

    samples = interleave({"a": cell("a", 1.0), "b": cell("b", 2.0)}, 3, warmup=1)
    assert calls == ["a", "b"] * 4
    assert samples == {"a": [1.0] * 3, "b": [2.0] * 3}


def test_a_ratio_is_of_the_medians_and_its_spread_is_of_the_paired_rounds():
    ratio = Ratio.of([2.0, 4.0, 9.0], [1.0, 2.0, 3.0])
    assert ratio.value == pytest.approx(4.0 / 2.0)
    assert (ratio.paired.min, ratio.paired.median, ratio.paired.max) == (2.0, 2.0, 3.0)


def test_goals_decide_met_and_a_dict_value_meets_only_when_every_part_does():
    assert goal_of("replay_vs_bare_scheduler").met(1.9) is True
    assert goal_of("replay_vs_bare_scheduler").met(2.1) is False
    assert goal_of("loader_spans_per_s").met(2_500_000) is True
    assert goal_of("outputs_identical").met(False) is False
    assert goal_of("hit_4k_vs_recompute").met(0.1) is None  # no goal set
    assert goal_of("store_vs_memcpy").met({"a": 0.9, "b": 0.7}) is False
    with pytest.raises(KeyError):
        Figure("not_a_key", 1.0, "")


def test_parts_of_a_peer_figure_from_two_sections_merge_into_one():
    alone = Figure("store_vs_lmcache", {"server_alone": 0.5}, "alone")
    inside = Figure("store_vs_lmcache", {"in_vllm": 0.8}, "inside")
    merged = merge([alone, inside])["store_vs_lmcache"]
    assert merged.value == {"server_alone": 0.5, "in_vllm": 0.8}
    assert merged.what == "alone; inside"
    failed = Figure("store_vs_lmcache", None, "", note="peer_servers failed")
    kept = merge([failed, inside])["store_vs_lmcache"]
    assert kept.value == {"in_vllm": 0.8} and kept.note == "peer_servers failed"
    with pytest.raises(ValueError):
        merge([Figure("store_vs_memcpy", 0.5, ""), Figure("store_vs_memcpy", 0.6, "")])


def _document(peer: bool, others_share: float) -> dict:
    load = {
        "wall_s": 10.0,
        "cpus": 2,
        "loadavg_before": [0.1, 0.1, 0.1],
        "loadavg_after": [0.2, 0.1, 0.1],
        "own_cpu_share": 0.5,
        "busy_cpu_share": 0.5 + others_share,
        "others_cpu_share": others_share,
    }
    figures = [Figure("tracing_overhead", 1.05, "on over off", ratio=Ratio.of([1.05], [1.0]))]
    return report.document(
        figures,
        [],
        run={"command": "kvtb bench", "peer": peer, "wall_s": 10.0, "finished": "now"},
        machine={"cpu_model": "cpu", "cpus": 2, "memory_gib": 1, "platform": "p", "python": "3"},
        versions={"kvtestbed": "0"},
        load=load,
        sections={"replay": {"load": load, "error": None}},
    )


def test_the_document_has_every_key_once_with_its_goal_verdict_and_the_load(tmp_path):
    doc = _document(peer=False, others_share=0.0)
    assert set(GOALS) <= set(doc) and not set(PEER_GOALS) & set(doc)
    assert doc["tracing_overhead"]["met"] is True
    assert doc["tracing_overhead"]["paired_ratio"]["n"] == 1
    assert doc["loader_spans_per_s"]["value"] is None
    assert doc["loader_spans_per_s"]["note"] == "its section did not run"
    report.write(tmp_path, doc)
    assert json.loads((tmp_path / report.RESULTS).read_text())["load"]["cpus"] == 2
    text = (tmp_path / report.MARKDOWN).read_text()
    assert "| `tracing_overhead` | 1.05 | ≤ 1.1× | ✓ |" in text
    assert "Provisional" not in text
    assert set(PEER_GOALS) <= set(_document(peer=True, others_share=0.0))


def test_a_run_on_a_loaded_machine_says_so_at_the_top():
    text = report.markdown(_document(peer=False, others_share=0.4))
    assert text.splitlines()[2].startswith("> **Provisional: measured on a loaded machine**")
    assert "other processes used 40% of all CPU time" in text


def test_a_hit_over_vllms_prefix_cache_is_the_difference_of_medians_with_paired_spread():
    from testbed.bench.e2e import OVER_PREFIX_CACHE, over_prefix_cache
    from testbed.bench.vllm_e2e import NATIVE

    def replies(ttfts_s: list[float]) -> list[dict]:
        return [{"first": {"ttft_s": 1.0}, "second": {"ttft_s": t}} for t in ttfts_s]

    n = OVER_PREFIX_CACHE
    answers = {
        (n, "worker"): replies([0.030, 0.010, 0.020]),
        (n, NATIVE): replies([0.004, 0.005, 0.009]),
    }
    figure = over_prefix_cache(answers)  # type: ignore[arg-type]
    assert figure.key == "hit_1k_over_prefix_cache_ms"
    assert figure.value == pytest.approx(20.0 - 5.0)  # medians 20 ms and 5 ms
    assert figure.spread is not None  # per-round differences: 26, 5, 11 ms
    assert (figure.spread.min, figure.spread.median, figure.spread.max) == pytest.approx(
        (5.0, 11.0, 26.0)
    )
    without_native = over_prefix_cache({(n, "worker"): replies([0.01])})  # type: ignore[arg-type]
    assert without_native.value is None and "--quick" in (without_native.note or "")


def test_the_mirrors_first_pass_is_read_against_recompute_at_each_length_measured():
    from testbed.bench.e2e import MIRROR_KEYS, recompute_figures
    from testbed.bench.vllm_e2e import MIRROR

    def replies(first_s: list[float]) -> list[dict]:
        return [{"first": {"ttft_s": t}, "second": {"ttft_s": t / 2}} for t in first_s]

    answers = {
        (1024, "no cache"): replies([0.010, 0.020, 0.030]),
        (1024, "worker"): replies([0.015, 0.030, 0.045]),  # a step's wait: 1.5x
        (1024, MIRROR): replies([0.010, 0.021, 0.030]),
    }
    figures = {f.key: f for f in recompute_figures(answers, (1024,))}  # type: ignore[arg-type]
    mirror = figures[MIRROR_KEYS[1024]]
    assert mirror.value == pytest.approx(1.0, abs=0.06)
    assert mirror.details["without_mirror"] == pytest.approx(1.5)
    assert figures[MIRROR_KEYS[4096]].value is None  # not measured at 4k here
