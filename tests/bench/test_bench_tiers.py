"""``kvtb bench``'s tiers section: the disk tier, a dd-style baseline and a promotion measured
in one run on real files, each figure with what it timed."""

from __future__ import annotations

from testbed.bench.config import BenchConfig
from testbed.bench.tiers import section


def test_the_disk_tier_is_measured_beside_dd_and_a_promotion_beside_memcpy(tmp_path):
    result = section(BenchConfig(out_dir=tmp_path, quick=True))
    figures = {figure.key: figure for figure in result.figures}
    assert set(figures) == {"disk_tier_write_vs_dd", "disk_tier_read_vs_dd", "promotion_vs_memcpy"}
    for figure in figures.values():
        assert figure.ratio is not None and figure.ratio.numerator.n == 3  # every round measured
        assert isinstance(figure.value, float) and figure.value > 0
    (table,) = result.tables
    assert [row[0] for row in table.rows] == [
        "tier write", "tier read", "dd write", "dd read", "promotion", "memcpy"
    ]  # fmt: skip
    assert not (tmp_path / "work" / "tiers").exists()  # its files are gone
