from testbed.run.interface import CacheServers
from testbed.run.options import RunOptions
from testbed.run.registry import ENGINES
from testbed.spec.engines import ENGINE_NAMES, ENGINE_RULES


def test_every_engine_a_spec_may_name_has_its_rules_and_a_registry_entry():
    assert list(ENGINES) == list(ENGINE_RULES) == list(ENGINE_NAMES)


def test_the_serve_engine_talks_to_the_runs_server_only_when_it_launches_vllm():
    serve = ENGINES["serve"]
    assert serve.cache_servers(RunOptions(launch=True)) is CacheServers.RUN
    assert serve.cache_servers(RunOptions(endpoint="http://h:1")) is CacheServers.OBSERVED
    assert ENGINES["oracle"].cache_servers(RunOptions()) is CacheServers.NONE
