"""The report's token-cause figure and miss-cause table, from run directories."""

from __future__ import annotations

import json

from testbed.analysis import attribution_plots as ap
from testbed.analysis.attribution import CATEGORIES
from testbed.analysis.palette import CATEGORY_LABELS
from tests.analysis.synthetic import Prompt, SyntheticRun

ABC = Prompt(("a", "b", "c"), tail=2)


def test_tokens_by_run_reads_summaries_or_computes_them_and_skips_runs_without_requests(
    tmp_path,
):
    measured = SyntheticRun(tmp_path / "measured", chunk_size=4)
    measured.request("r1", ABC)
    measured.evict(ABC.hashes[1:2])
    measured.request("r2", ABC)
    measured.close()
    summarized = tmp_path / "summarized"
    summarized.mkdir()
    (summarized / "summary.json").write_text(json.dumps({"tokens": {"cold": 5, "external": 3}}))
    (tmp_path / "oracle" / "spans").mkdir(parents=True)
    table = ap.tokens_by_run(
        {
            "measured": tmp_path / "measured",
            "summarized": summarized,
            "oracle": tmp_path / "oracle",
        }
    )
    assert list(table["label"]) == ["measured", "summarized"]
    rows = table.set_index("label")
    assert rows.loc["measured", list(CATEGORIES)].to_dict() == {
        **dict.fromkeys(CATEGORIES, 0),
        "external": 4,
        "cold": 12,
        "capacity": 8,
        "partial_chunk": 2,
        "last_token": 2,
    }
    assert rows.loc["summarized", "cold"] == 5 and rows.loc["summarized", "engine"] == 0

    misses = ap.miss_cause_table(table).set_index("run")
    assert misses.loc["measured", "missed"] == "24 (85.7%)"
    assert misses.loc["measured", "capacity"] == "8 (33.3%)"
    assert misses.loc["summarized", "in_flight"] == "0 (0.0%)"

    figure = ap.where_tokens_went(table, "label", "Where every prompt token went")
    axes = figure.axes[0]
    assert [t.get_text() for t in axes.get_legend().get_texts()] == [
        CATEGORY_LABELS[name] for name in CATEGORIES
    ]
    tops = [p.get_y() + p.get_height() for p in axes.patches if p.get_height() > 0]
    assert max(tops) == 100.0
    ap.plt.close(figure)
