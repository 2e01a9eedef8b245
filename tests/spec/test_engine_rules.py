"""The spec's per-engine rules are data (``testbed.spec.engines``): the spec checks a run against
its engine's row, the closed sets are ``Literal`` fields checked when a spec is converted and
when one is constructed, and the oracle runs every policy its model simulates."""

from __future__ import annotations

import dataclasses

import pytest

from testbed.models.oracle import POLICIES as ORACLE_MODEL_POLICIES
from testbed.run import RunOptions, execute_run
from testbed.spec.engines import ENGINE_RULES, EngineRules
from testbed.spec.runspec import RunSpec


def test_the_spec_checks_a_run_against_its_engines_row(monkeypatch):
    for name, rules in ENGINE_RULES.items():
        for policy in rules.policies:
            RunSpec(engine=name, policy=policy)
    with pytest.raises(ValueError, match="policy 'belady' is not available with engine replay"):
        RunSpec(engine="replay", policy="belady")
    with pytest.raises(ValueError, match="model applies to the vllm and serve engines only"):
        RunSpec(engine="replay", model="some/model")
    # A row changed is a rule changed, with no engine name compared anywhere.
    rules = dict(ENGINE_RULES)
    rules["replay"] = dataclasses.replace(rules["replay"], model=True, policies=("belady",))
    monkeypatch.setattr("testbed.spec.runspec.ENGINE_RULES", rules)
    monkeypatch.setattr("testbed.spec.engines.ENGINE_RULES", rules)
    RunSpec(engine="replay", model="some/model", policy="belady")
    with pytest.raises(ValueError, match="model applies to the replay, vllm and serve engines"):
        RunSpec(engine="oracle", model="some/model", policy="belady")


def test_closed_sets_are_refused_on_conversion_and_construction():
    with pytest.raises(ValueError, match=r"engine = 'nope' is not a value of type one of"):
        RunSpec.from_mapping({"engine": "nope"})
    with pytest.raises(ValueError, match="engine must be one of replay, fleet, vllm, serve"):
        RunSpec(engine="nope")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="transfer_mode must be one of worker, server"):
        RunSpec(transfer_mode="peer")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"arrival = 'burst' is not a value of type one of"):
        RunSpec.from_mapping({"arrival": "burst"})
    assert RunSpec.from_mapping({"servers": "per-instance", "engine": "fleet"}).servers == (
        "per-instance"
    )


def test_the_oracle_takes_every_policy_its_model_simulates(tmp_path):
    assert ENGINE_RULES["oracle"].policies == ORACLE_MODEL_POLICIES
    assert {"lru", "fifo", "lfu", "belady"} <= set(ORACLE_MODEL_POLICIES)
    hits = {}
    for policy in ("fifo", "lfu", "belady"):
        spec = RunSpec(engine="oracle", policy=policy, requests=60, capacity_tokens=2048)
        summary = execute_run(spec, tmp_path, RunOptions(progress=False))
        assert summary["requests"] == 60
        hits[policy] = summary["tokens"]["external"]
    assert hits["belady"] >= max(hits["fifo"], hits["lfu"])  # MIN is the best a policy does


def test_an_engines_rules_default_to_a_replay_like_engine():
    assert EngineRules() == ENGINE_RULES["replay"]
