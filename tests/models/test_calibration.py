"""Measured figures: fitted from prefill and load times, loaded from a run's file, and used by
every projection (break-even lengths included) in place of the datasheet's assumptions."""

from __future__ import annotations

import numpy as np
import pytest

from testbed.models.calibration import calibrate, calibration_toml, fit_compute_efficiency, fit_load
from testbed.models.hardware import HARDWARE, load_hardware
from testbed.models.profiles import get_profile
from testbed.models.projections import break_even_prompt_tokens, break_even_table
from testbed.models.time_model import RooflineTimeModel

LLAMA = get_profile("llama3-8b")
H200 = HARDWARE["h200"]


def _prefills(efficiency: float, lengths=(1024, 4096, 16384)) -> list[tuple[int, float]]:
    model = RooflineTimeModel(H200, LLAMA)
    rate = H200.peak_flops * efficiency
    return [(n, model.flops(np.array([n]), np.array([0])) / rate * 1e3) for n in lengths]


def test_the_fit_recovers_the_efficiency_and_load_line_that_made_the_points():
    assert fit_compute_efficiency(H200, LLAMA, _prefills(0.37)) == pytest.approx(0.37)
    per_token = LLAMA.bytes_per_token()
    loads = [(n, (2e-4 + n * per_token / 48e9) * 1e3) for n in (1024, 4096, 16384)]
    rate, latency = fit_load(per_token, loads)
    assert rate == pytest.approx(48e9, rel=1e-6)
    assert latency == pytest.approx(2e-4, rel=1e-4)


def test_the_shipped_h200_profile_waits_for_a_device_run():
    assert not H200.measured
    assert H200.measured_prefill_ms is None and H200.measured_load_bytes_per_s is None


def test_measured_figures_change_the_projections_and_the_break_even(tmp_path):
    slow_loads = [(n, n * LLAMA.bytes_per_token() / 5e9 * 1e3) for n in (2048, 8192)]
    measured = calibrate(H200, LLAMA, _prefills(0.6), slow_loads, source="test points")
    path = tmp_path / "h200.toml"
    path.write_text(calibration_toml(measured))
    table = load_hardware(path)
    loaded = table["h200"]
    assert loaded.measured and loaded.measured_prefill_ms is not None
    assert np.allclose(loaded.measured_prefill_ms, measured.measured_prefill_ms or (), rtol=1e-4)
    assert loaded.measured_source == "test points"
    assert loaded.peak_flops == H200.peak_flops  # datasheet figures kept beside the measured

    datasheet = break_even_prompt_tokens(RooflineTimeModel(H200, LLAMA), 256)
    calibrated = break_even_prompt_tokens(RooflineTimeModel(loaded, LLAMA), 256)
    assert datasheet is not None and calibrated is not None
    assert calibrated > datasheet  # loads 10x slower than the datasheet link: pays later
    assert RooflineTimeModel(loaded.datasheet(), LLAMA).step_s([512], [0], [4096]) == (
        RooflineTimeModel(H200, LLAMA).step_s([512], [0], [4096])
    )
    rows = break_even_table(LLAMA, ["h200", "h100"], [256], hardware=table)
    assert {row["hardware"]: row["basis"] for row in rows} == {
        "h200": "measured",
        "h100": "datasheet",
    }
