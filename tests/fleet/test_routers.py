"""Routers as strategies: what each one decides from what it sees (pure, no engine)."""

from __future__ import annotations

import pytest

from testbed.fleet.block_index import BlockLocations
from testbed.fleet.kv_index import KVEventIndex
from testbed.fleet.load import LoadBook
from testbed.fleet.routers import ROUTERS, FleetView, RouteRequest, make_router, with_peers
from testbed.spec.runspec import RunSpec

BLOCK = 16


def request(request_id: str, blocks: list[str], group: str = "", tail: int = 5) -> RouteRequest:
    return RouteRequest(request_id, group, len(blocks) * BLOCK + tail, blocks)


def view(n: int, load: LoadBook | None = None, kv=None, cached=(), engine_blocks=64) -> FleetView:
    return FleetView(n, BLOCK, engine_blocks, load or LoadBook(n), kv, cached)


def route(router, req: RouteRequest, fleet: FleetView) -> int:
    choice = router.choose(req, fleet)
    router.routed(req, choice.instance, fleet)
    fleet.load.dispatched(req.request_id, choice.instance, req.prompt_tokens)
    return choice.instance


def test_round_robin_cycles_and_least_loaded_follows_the_routers_book():
    rr = make_router("round_robin", {}, 3, 0)
    fleet = view(3)
    assert [route(rr, request(f"r{i}", ["a"]), fleet) for i in range(5)] == [0, 1, 2, 0, 1]
    book = LoadBook(2)
    least = make_router("least_loaded", {}, 2, 0)
    fleet = view(2, book)
    assert route(least, request("big", ["a"] * 10), fleet) == 0
    assert route(least, request("small", ["b"]), fleet) == 1  # 0 holds 165 queued tokens
    assert route(least, request("next", ["c"]), fleet) == 1  # 21 < 165
    book.first_token("big")  # queued → running: still load
    assert book.load_tokens() == [165, 42] and book.queued_tokens == [0, 42]
    book.finished("big")
    assert book.load_tokens() == [0, 42] and book.requests == [0, 2]
    assert route(least, request("after", ["d"]), fleet) == 0


def test_session_is_sticky_per_group_and_spreads_groupless_requests():
    session = make_router("session", {}, 2, 0)
    fleet = view(2)
    first = route(session, request("a1", ["x"] * 4, group="conv-a"), fleet)
    other = route(session, request("b1", ["y"] * 4, group="conv-b"), fleet)
    assert first != other  # the second conversation starts on the less loaded instance
    assert route(session, request("a2", ["x"] * 8, group="conv-a"), fleet) == first
    assert route(session, request("b2", ["y"] * 8, group="conv-b"), fleet) == other
    fleet.load.finished("b1")
    assert route(session, request("n1", ["z"]), fleet) == other  # no group: the least loaded


def test_prefix_approx_remembers_what_it_sent_where_and_forgets_beyond_the_pool():
    router = make_router("prefix_approx", {"capacity_blocks": 4}, 2, 0)
    fleet = view(2)
    first = request("a", ["p", "q", "r"])
    assert route(router, first, fleet) == 0  # nothing known anywhere: the lower index
    fleet.load.finished("a")
    again = request("a2", ["p", "q", "r", "u"])
    costs = router.choose(again, fleet).costs
    assert costs[1] - costs[0] == 3  # it remembers sending p, q, r to instance 0
    assert route(router, again, fleet) == 0
    fleet.load.finished("a2")
    assert route(router, request("b", ["v", "w", "x"], tail=0), fleet) == 0
    fleet.load.finished("b")
    # Four blocks per instance: v, w, x pushed p, q, r out of what it remembers for 0.
    costs = router.choose(request("a3", ["p", "q", "r", "u"]), fleet).costs
    assert costs[0] == costs[1]


def test_kv_precise_weighs_the_cached_prefix_against_load_and_credits_the_cache_server():
    index = KVEventIndex([0, 1])  # one cache server per instance
    index.stored(0, "GPU", ["a", "b", "c", "d"])  # instance 0's prefix cache: 4 blocks
    index.stored(1, "kvtb", ["a", "b", "c", "d", "e", "f"])  # instance 1's server: 6 blocks
    req = request("r", ["a", "b", "c", "d", "e", "f", "g", "h"])
    book = LoadBook(2)
    precise = make_router("kv_precise", {}, 2, 0)
    choice = precise.choose(req, view(2, book, index))
    # new_0 = 9 - 4 = 5 blocks; new_1 = 9 - 0 - 0.8 x 6 = 4.2 blocks: the server wins.
    assert choice.costs == pytest.approx((5.0, 4.2)) and choice.instance == 1
    no_credit = make_router("kv_precise", {"external_credit": 0.0}, 2, 0)
    assert no_credit.choose(req, view(2, book, index)).instance == 0
    book.dispatched("busy", 1, 10 * BLOCK)  # 10 queued blocks on instance 1
    assert precise.choose(req, view(2, book, index)).instance == 0
    heavy = make_router("kv_precise", {"prefill_weight": 0.0}, 2, 0)  # load only: running
    book.first_token("busy")
    assert heavy.choose(req, view(2, book, index)).instance == 0


def test_a_temperature_samples_from_the_seed_and_zero_is_deterministic():
    index = KVEventIndex([0, 0, 0])
    index.stored(0, "GPU", ["a", "b"])
    req = request("r", ["a", "b", "c"])
    picks = []
    for seed in (1, 1, 2):
        router = make_router("kv_precise", {"temperature": 1.0}, 3, seed)
        picks.append([router.choose(req, view(3, kv=index)).instance for _ in range(40)])
    assert picks[0] == picks[1] and picks[0] != picks[2]
    assert len(set(picks[0])) == 3 and picks[0].count(0) > picks[0].count(1)
    cold = make_router("kv_precise", {}, 3, 7)
    assert {cold.choose(req, view(3, kv=index)).instance for _ in range(10)} == {0}


def test_the_oracle_takes_the_longest_real_prefix_whatever_the_load():
    oracle = make_router("oracle", {}, 3, 0)
    book = LoadBook(3)
    book.dispatched("x", 2, 10_000)
    assert oracle.choose(request("r", ["a"]), view(3, book, cached=[1, 0, 3])).instance == 2
    assert oracle.choose(request("r", ["a"]), view(3, book, cached=[0, 0, 0])).instance == 0
    book.dispatched("y", 0, 5)
    assert oracle.choose(request("r", ["a"]), view(3, book, cached=[2, 2, 0])).instance == 1


def test_block_locations_count_copies_and_find_each_holders_prefix_in_one_walk():
    index = BlockLocations(3, counted=True)
    index.add(0, ["a", "b", "c"])
    index.add(1, ["a", "b"])
    index.add(1, ["b"])  # a second copy of b on 1
    assert index.prefix_blocks(["a", "b", "c", "d"]) == [3, 2, 0]
    index.remove(1, ["b"])
    assert index.prefix_blocks(["a", "b", "c"]) == [3, 2, 0]  # one copy left
    index.remove(1, ["b"])
    assert index.prefix_blocks(["a", "b", "c"]) == [3, 1, 0]
    index.remove(2, ["zzz"])  # unknown: ignored
    index.clear(0)
    assert index.prefix_blocks(["a", "b"]) == [0, 1, 0] and index.num_blocks(0) == 0
    lru = BlockLocations(1, capacity_blocks=2)
    lru.add(0, ["a", "b"])
    lru.touch(0, ["a"])
    lru.add(0, ["c"])  # b is the least recent
    assert lru.holds(0, "a") and not lru.holds(0, "b") and lru.holds(0, "c")


def test_bad_router_names_and_params_are_refused_with_the_valid_choices():
    with pytest.raises(ValueError, match="choose one of round_robin, least_loaded"):
        make_router("sticky", {}, 2, 0)
    with pytest.raises(ValueError, match="router kv_precise params:.*temprature"):
        make_router("kv_precise", {"temprature": 1.0}, 2, 0)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        make_router("kv_precise", {"temperature": -1}, 2, 0)
    with pytest.raises(ValueError, match="router round_robin params"):
        make_router("round_robin", {"temperature": 1}, 2, 0)
    with pytest.raises(ValueError, match="needs the fleet engine"):
        RunSpec(engine="replay", instances=4)
    with pytest.raises(ValueError, match="router and router_params apply"):
        RunSpec(engine="replay", router="session")
    with pytest.raises(ValueError, match="servers must be one of shared, per-instance"):
        RunSpec(engine="fleet", servers="one")
    spec = RunSpec(
        engine="fleet", instances=4, router="kv_precise", router_params={"temperature": 0.5}
    )
    assert spec.run_id != RunSpec(engine="fleet", instances=4, router="kv_precise").run_id
    assert set(ROUTERS) == {
        "round_robin",
        "least_loaded",
        "session",
        "prefix_approx",
        "kv_precise",
        "oracle",
    }


def test_the_command_line_takes_fleet_keys_and_router_params():
    import argparse

    from testbed.spec.flags import add_spec_arguments, spec_from_args

    parser = argparse.ArgumentParser()
    add_spec_arguments(parser)
    args = parser.parse_args(
        ["--engine", "fleet", "--instances", "4", "--router", "kv_precise",
         "--router-param", "temperature=0.5", "--router-param", "external_credit=1",
         "--servers", "per-instance", "--workload-param", "system_prompt_tokens=64"]
    )  # fmt: skip
    spec = spec_from_args(args)
    assert (spec.engine, spec.instances, spec.router, spec.servers) == (
        "fleet",
        4,
        "kv_precise",
        "per-instance",
    )
    assert spec.router_params == {"temperature": 0.5, "external_credit": 1}
    assert spec.workload_params == {"system_prompt_tokens": 64}
    bad = parser.parse_args(["--engine", "fleet", "--router", "kv_precise",
                             "--router-param", "tempreature=1"])  # fmt: skip
    with pytest.raises(ValueError, match="tempreature"):
        spec_from_args(bad)


def test_kv_precise_credits_a_block_by_the_tier_that_holds_it_by_its_load_time():
    index = KVEventIndex([0, 1, 2])  # one cache server per instance
    blocks = ["a", "b", "c", "d", "e", "f"]
    index.stored(0, "kvtb", blocks)  # instance 0's server: the prefix in L1
    index.stored(1, "kvtb/disk", blocks)  # instance 1's server: on its disk only
    req = request("r", [*blocks, "g", "h"])
    precise = make_router("kv_precise", {}, 3, 0)
    costs = precise.choose(req, view(3, kv=index)).costs
    assert costs[0] < costs[1] < costs[2]
    credits = precise.credits  # type: ignore[attr-defined]
    assert credits["host"] == 0.8 and 0 < credits["disk"] < credits["host"]
    assert costs[1] == pytest.approx(costs[2] - 6 * credits["disk"])
    # A block both in L1 and on disk is credited once, as the cheaper load.
    index.stored(0, "kvtb/disk", blocks[:4])
    assert precise.choose(req, view(3, kv=index)).costs[0] == pytest.approx(costs[0])
    # Beyond L1's four blocks, the disk's two more are credited as disk loads.
    index.removed(0, "kvtb", blocks[4:])
    index.stored(0, "kvtb/disk", blocks)
    expected = costs[2] - 4 * credits["host"] - 2 * credits["disk"]
    assert precise.choose(req, view(3, kv=index)).costs[0] == pytest.approx(expected)
    # Peers (another server's L1) are credited only when asked.
    peers = make_router("kv_precise", {"peers": True}, 3, 0)
    assert peers.choose(req, view(3, kv=index)).costs[2] < costs[2]
    # A run with --p2p asks for them, unless its params say otherwise.
    assert with_peers("kv_precise", {}, p2p=True) == {"peers": True}
    assert with_peers("kv_precise", {"peers": False}, p2p=True) == {"peers": False}
    assert with_peers("kv_precise", {}, p2p=False) == {}
    assert with_peers("round_robin", {}, p2p=True) == {}
    with pytest.raises(ValueError, match="unknown tier profile"):
        make_router("kv_precise", {"tier_profile": "floppy"}, 3, 0)
