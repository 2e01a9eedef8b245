"""The time model: the flat clock as before, a roofline per GPU, monotone where it must be."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from testbed.models.hardware import HARDWARE, Hardware, load_hardware
from testbed.models.profiles import get_profile
from testbed.models.projections import break_even_prompt_tokens, request_ttft_s
from testbed.models.time_model import FlatTimeModel, RooflineTimeModel, make_time_model

LLAMA = get_profile("llama3-8b")


def test_flat_is_the_replays_clock_and_loads_are_free():
    flat = make_time_model("flat", get_profile("tiny"))
    assert isinstance(flat, FlatTimeModel)
    # step = step_overhead_ms + prefill_token_us x scheduled tokens, 5 ms and 40 us.
    assert flat.step_s([100, 1, 1], [0, 50, 7]) == pytest.approx(5e-3 + 40e-6 * 102)
    assert flat.step_s([100], [0], [900]) == flat.step_s([100], [0])
    ttft = request_ttft_s(flat, [1000] * 4, [0, 256, 512, 999])
    assert np.all(np.diff(ttft) < 0)  # more hits, shorter TTFT


def test_the_roofline_is_compute_bound_for_long_prefills_and_memory_bound_for_decode():
    model = RooflineTimeModel(HARDWARE["h100"], LLAMA)
    h = model.hardware
    prefill = model.step_s([8192], [0])
    flops = 2 * LLAMA.num_active_params * 8192 + model.attention_flops_per_pair * 8192 * 8193 / 2
    assert prefill == pytest.approx(flops / (h.peak_flops * h.compute_efficiency))
    decode = model.step_s([1], [4096])
    weights_and_kv = 2 * LLAMA.num_params + 4097 * LLAMA.bytes_per_token()
    assert decode == pytest.approx(weights_and_kv / (h.hbm_bytes_per_s * h.memory_efficiency))
    # A batch reads the weights once: cheaper than its requests one by one.
    batch = model.step_s([1, 1, 1], [4096, 100, 9000])
    alone = [model.step_s([1], [c]) for c in (4096, 100, 9000)]
    assert max(alone) <= batch < sum(alone)
    assert model.step_s([1000], [0]) == pytest.approx(
        float(model.isolated_s(np.array([1000]), np.array([0]), np.array([0]))[0])
    )


@pytest.mark.parametrize("name", sorted(HARDWARE))
def test_more_hits_never_project_a_longer_ttft_when_loads_are_faster_than_recompute(name):
    model = RooflineTimeModel(HARDWARE[name], LLAMA, chunk_size=256)
    h = model.hardware
    load_per_token = model.kv_bytes_per_token / (h.link_bytes_per_s * h.link_efficiency)
    compute_per_token = model.linear_flops_per_token / (h.peak_flops * h.compute_efficiency)
    assert load_per_token < compute_per_token  # the shipped profiles: loading beats recompute
    break_even = break_even_prompt_tokens(model, 256)
    assert break_even is not None
    for prompt in (break_even, 1000, 8192, 32768, 131072):
        hits = np.arange(0, prompt, 256)
        ttft = request_ttft_s(model, np.full(len(hits), prompt), hits)
        assert np.all(ttft <= ttft[0] * (1 + 1e-12)), (name, prompt)
        # While the rest of the prefill is compute-bound, each further chunk of hits helps.
        new = prompt - hits
        compute = model.flops(new, hits) / (h.peak_flops * h.compute_efficiency)
        memory = (2 * LLAMA.num_params + prompt * model.kv_bytes_per_token) / (
            h.hbm_bytes_per_s * h.memory_efficiency
        )
        bound = compute >= memory
        assert np.all(np.diff(ttft[bound]) <= 0), (name, prompt)


def test_a_slow_link_makes_loading_worse_than_recomputing():
    slow = Hardware("slow", peak_flops=989e12, hbm_bytes_per_s=3.35e12, link_bytes_per_s=1e9)
    model = RooflineTimeModel(slow, LLAMA)
    ttft = request_ttft_s(model, [32768] * 3, [0, 8192, 16384])
    assert ttft[0] < ttft[1] < ttft[2]
    assert break_even_prompt_tokens(model, 256, max_prompt_tokens=1 << 16) is None


def test_break_even_is_the_first_prompt_from_which_a_full_hit_always_pays():
    for name in ("h100", "h200"):
        model = make_time_model(name, LLAMA, chunk_size=256)
        tokens = break_even_prompt_tokens(model, 256)
        assert tokens is not None and tokens >= 257
        prompts = np.arange(tokens, tokens + 4096)
        full = (prompts - 1) // 256 * 256
        assert np.all(
            request_ttft_s(model, prompts, full) < request_ttft_s(model, prompts, 0 * full)
        )
        if tokens > 257:
            before = tokens - 1
            hit = (before - 1) // 256 * 256
            assert (
                request_ttft_s(model, [before], [hit])[0] >= request_ttft_s(model, [before], [0])[0]
            )


def test_hardware_profiles_extend_from_toml_and_bad_keys_are_named(tmp_path):
    path = tmp_path / "gpus.toml"
    path.write_text(
        "[b200]\npeak_flops = 2.25e15\nhbm_bytes_per_s = 8e12\nlink_bytes_per_s = 64e9\n"
        "[h100]\ncompute_efficiency = 0.7\n"
    )
    table = load_hardware(path)
    assert table["b200"].peak_flops == 2.25e15 and table["b200"].compute_efficiency == 0.5
    assert table["h100"].compute_efficiency == 0.7
    assert table["h100"].peak_flops == HARDWARE["h100"].peak_flops
    assert make_time_model("b200", LLAMA, hardware=table).name == "b200"
    path.write_text("[x]\npeak_flop = 1\n")
    with pytest.raises(ValueError, match="unknown keys \\['peak_flop'\\]"):
        load_hardware(path)
    with pytest.raises(ValueError, match="no compute shape"):
        make_time_model("h100", get_profile("tiny"))
    with pytest.raises(ValueError, match="unknown time profile 'tpu'"):
        make_time_model("tpu", LLAMA)


def _arrays_step_s(model, new, context, loaded):
    """The step through the model's NumPy formulas, as every step went before."""
    as_array = functools.partial(np.asarray, dtype=np.float64)
    return float(model._step_s(as_array(new), as_array(context), as_array(loaded)))


@pytest.mark.parametrize("overlap", [False, True])
def test_a_step_on_python_numbers_is_the_numpy_formulas_to_the_bit(overlap):
    hardware = dataclasses.replace(HARDWARE["h100"], overlap_loads=overlap)
    models = [
        RooflineTimeModel(hardware, LLAMA, chunk_size=256),
        RooflineTimeModel(hardware, get_profile("deepseek-mla"), tp=2, chunk_size=64),
        FlatTimeModel(),
    ]
    rng = np.random.default_rng(7)
    loads_seen = 0
    for _ in range(400):
        size = int(rng.integers(0, 40))  # past NumPy's 8-way pairwise sums
        new = [int(x) for x in rng.integers(1, 9000, size)]
        context = [int(x) for x in rng.integers(0, 130000, size)]
        loaded = [0] * size
        if size and rng.random() < 0.5:
            loaded[int(rng.integers(0, size))] = int(rng.integers(1, 20000))
            loads_seen += 1
        for model in models:
            exact = model.step_s(new, context, loaded)
            assert exact.hex() == _arrays_step_s(model, new, context, loaded).hex()
            if isinstance(model, RooflineTimeModel):
                assert model._integer_step_s(new, context, loaded) is not None  # no fallback
    assert loads_seen > 100
    # What Python numbers cannot give to the bit goes through the arrays.
    model = models[0]
    assert model._integer_step_s([1, 1], [10, 10], [300, 500]) is None
    assert model._integer_step_s([1.5], [10], [0]) is None
    assert model._integer_step_s([2**30], [2**30], [0]) is None  # past exact floats
    # A negative load is no load, as the arrays' mask has it.
    for loaded in ([-4, 0], [-4, 300]):
        assert model.step_s([5, 7], [10, 3], loaded) == _arrays_step_s(
            model, [5, 7], [10, 3], loaded
        )
    assert model.step_s([1, 1], [10, 10], [300, 500]) == _arrays_step_s(
        model, [1, 1], [10, 10], [300, 500]
    )
