"""Every prompt token in one category: hand-made scenarios, each category against a count made
by hand, and a randomized comparison with a token-by-token reference of the contract's rules."""

from __future__ import annotations

import random

import pytest

from testbed.analysis import attribution as acc
from testbed.analysis.chunklog import write_chunk_parquet
from testbed.analysis.tables import Run
from tests.analysis.synthetic import Admission, Prompt, SyntheticRun, chunk_hashes

C = 4
ABC = Prompt(("a", "b", "c"), tail=2)  # P = 14: chunks [0,4) [4,8) [8,12), tail [12,14)


def abc_tail(**tokens: int) -> dict[str, int]:
    """``tokens`` and what :data:`ABC`'s tail always is: one partial-chunk token (its tail
    but the last token) and the last token."""
    return {**tokens, "partial_chunk": 1, "last_token": 1}


def categories(table, request_id):
    row = table[table["request_id"] == request_id].iloc[0]
    return {name: int(row[name]) for name in acc.CATEGORIES if int(row[name])}


@pytest.fixture
def synthetic(tmp_path):
    runs = []

    def make(**kwargs):
        run = SyntheticRun(tmp_path / f"run{len(runs)}", chunk_size=C, **kwargs)
        runs.append(run)
        return run

    yield make
    for run in runs:
        run.close()


def test_a_first_request_misses_cold_except_its_tail_and_last_token(synthetic):
    run = synthetic()
    run.request("r1", ABC)
    table = acc.attribution(run.close())
    assert categories(table, "r1") == abc_tail(cold=12)
    row = table.iloc[0]
    assert (row["external_hit_tokens"], row["recomputed_tokens"], row["server_hit_tokens"]) == (
        0,
        14,
        0,
    )
    assert row["causes_resolved"] and table.attrs["chunk_log"]
    assert (row["workload_request_id"], row["group"], row["session_id"]) == (
        "w-r1",
        "g",
        "synthetic:r1",
    )


def test_an_evicted_chunk_is_a_capacity_miss_and_the_hits_behind_it_follow_it(synthetic):
    run = synthetic()
    run.request("r1", ABC)
    run.evict(ABC.hashes[1:2])
    run.request("r2", ABC)
    table = acc.attribution(run.close())
    # Chunk 0 loaded; chunk 1 evicted; chunk 2 still held but behind the miss.
    assert categories(table, "r2") == abc_tail(external=4, capacity=8)


def test_a_dropped_chunk_counts_as_capacity_too(synthetic):
    run = synthetic()
    run.request("r1", ABC)
    run.evict(ABC.hashes[0:1], reason="drop")
    run.request("r2", ABC)
    assert categories(acc.attribution(run.close()), "r2") == abc_tail(capacity=12)


def test_a_chunk_reserved_but_not_committed_at_lookup_is_in_flight(synthetic):
    run = synthetic()
    run.request("r0", Prompt(("a",)))  # chunk 0 committed
    run.request("r1", ABC, store="reserve")  # chunks 1 and 2 reserved, not committed
    run.request("r2", ABC)
    run.commit("synthetic:r1")
    run.request("r3", ABC)
    table = acc.attribution(run.close())
    assert categories(table, "r2") == abc_tail(external=4, in_flight=8)
    assert categories(table, "r3") == abc_tail(external=12)


def test_an_aborted_store_leaves_the_chunks_cold(synthetic):
    run = synthetic()
    run.request("r1", ABC, store="abort")
    run.request("r2", ABC)
    assert categories(acc.attribution(run.close()), "r2") == abc_tail(cold=12)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        # Shorter than a chunk: no lookup at all.
        (Prompt((), tail=3), {"partial_chunk": 2, "last_token": 1}),
        # A whole number of chunks: the last token is in a complete chunk, and is computed.
        (Prompt(("a", "b")), {"external": 7, "last_token": 1}),
        # One chunk and a tail: the tail's tokens but the last are partial.
        (Prompt(("a",), tail=3), {"external": 4, "partial_chunk": 2, "last_token": 1}),
    ],
)
def test_partial_chunks_and_the_last_token(synthetic, prompt, expected):
    run = synthetic()
    run.request("r1", Prompt(("a", "b", "c")))
    run.request("r2", prompt)
    table = acc.attribution(run.close())
    assert categories(table, "r2") == expected
    if not prompt.labels:
        assert table.set_index("request_id").loc["r2", "lookup_status"] == acc.LOOKUP_NONE


def test_a_middle_chunk_failing_on_one_of_two_ranks_fails_everything_after_it(synthetic):
    run = synthetic(tp=2)
    prompt = Prompt(("a", "b", "c", "d"), tail=1)  # P = 17
    run.request("r1", prompt)
    # Rank 0 loads all 16 promised tokens; rank 1 fails at chunk 2 (token 8) and rank 0 later
    # at chunk 3 in another request: vLLM recomputes from the first failed block of any rank.
    run.request("r2", prompt, retrieve={1: 8})
    run.request("r3", prompt, retrieve={0: 12, 1: 8})
    run.request("r4", prompt, engine_hit=4, retrieve={0: 12})
    table = acc.attribution(run.close()).set_index("request_id")
    for request_id in ("r2", "r3"):
        assert categories(table.reset_index(), request_id) == {
            "external": 8,
            "load_failed": 8,
            "last_token": 1,
        }
        assert table.loc[request_id, "promised_tokens"] == 16
        assert table.loc[request_id, "load_failed_tokens"] == 8
    assert categories(table.reset_index(), "r4") == {
        "engine": 4,
        "external": 8,
        "load_failed": 4,
        "last_token": 1,
    }


def test_a_rank_without_a_retrieve_fails_the_whole_load(synthetic):
    run = synthetic(tp=2)
    run.request("r1", ABC)
    run.request("r2", ABC, engine_hit=4, retrieve={1: "missing"})
    assert categories(acc.attribution(run.close()), "r2") == abc_tail(engine=4, load_failed=8)


def test_a_lookup_that_failed_makes_the_complete_chunks_unavailable(synthetic):
    run = synthetic()
    run.request("r1", ABC)
    run.request("r2", ABC, lookup=acc.LOOKUP_UNAVAILABLE)
    run.request("r3", ABC, lookup=acc.LOOKUP_UNAVAILABLE, engine_hit=4)
    table = acc.attribution(run.close())
    assert categories(table, "r2") == abc_tail(unavailable=12)
    assert categories(table, "r3") == abc_tail(engine=4, unavailable=8)
    assert table.set_index("request_id")["server_hit_tokens"].isna().loc["r2"]


def test_a_lookup_refused_for_a_limit_is_its_own_cause_not_a_failure(synthetic):
    run = synthetic()
    run.request("r1", ABC)
    refusal = "quota: refused: over this client's quota of 1 live sessions"
    run.request("r2", ABC, lookup=acc.LOOKUP_REFUSED, lookup_error=refusal, engine_hit=4)
    table = acc.attribution(run.close())
    assert categories(table, "r2") == abc_tail(engine=4, refused=8)
    assert table.set_index("request_id")["unavailable"].sum() == 0


def test_chunks_the_server_held_but_nothing_loaded_are_engine_only(synthetic):
    run = synthetic()
    run.request("r1", ABC)
    run.request("r2", ABC, promised=0)  # vLLM loaded nothing (its allocation decided)
    run.request("r3", ABC, engine_hit=4, promised=4)  # loaded chunk 1 only
    run.request("r4", ABC, engine_hit=12)  # vLLM's own hit covers the server's
    table = acc.attribution(run.close())
    assert categories(table, "r2") == abc_tail(engine_only=12)
    assert categories(table, "r3") == abc_tail(engine=4, external=4, engine_only=4)
    assert categories(table, "r4") == abc_tail(engine=12)


def test_mla_stores_one_copy_and_every_tp_rank_reads_it(synthetic):
    run = synthetic(tp=2, mla=True)
    run.request("r1", ABC)  # only TP rank 0 stores (KV rank 0)
    run.request("r2", ABC)  # both ranks load chunks 0-2
    run.request("r3", ABC, retrieve={1: 4})  # TP rank 1 fails at chunk 1
    run.evict(ABC.hashes[2:3])
    run.request("r4", ABC)
    table = acc.attribution(run.close())
    assert categories(table, "r1") == abc_tail(cold=12)
    assert categories(table, "r2") == abc_tail(external=12)
    assert categories(table, "r3") == abc_tail(external=4, load_failed=8)
    assert categories(table, "r4") == abc_tail(external=8, capacity=4)


@pytest.mark.parametrize("server", [True, False])
def test_without_a_chunk_log_misses_count_as_cold_and_say_so(synthetic, server):
    run = synthetic(chunk_log=False, server=server)
    run.request("r1", ABC)
    run.evict(ABC.hashes[1:2])
    run.request("r2", ABC)
    run.request("r3", ABC)
    table = acc.attribution(run.close())
    assert not table.attrs["chunk_log"]
    # r2's capacity miss cannot be told from a cold one without the log.
    assert categories(table, "r2") == abc_tail(external=4, cold=8)
    assert categories(table, "r3") == abc_tail(external=12)
    assert list(table["causes_resolved"]) == [False, False, True]


def test_requests_whose_lookup_missed_nothing_need_no_chunk_log(synthetic):
    run = synthetic(chunk_log=False)
    run.request("r1", Prompt((), tail=3))
    table = acc.attribution(run.close())
    assert table["causes_resolved"].all()


def test_the_parquet_chunk_log_gives_the_same_accounting(synthetic):
    run = synthetic(tp=2)
    run.request("r1", ABC)
    run.evict(ABC.hashes[1:2])
    run.request("r2", ABC, retrieve={1: 4})
    run.request("r3", ABC, store="reserve")
    run.request("r4", Prompt(("a", "b", "c", "d")))
    run_dir = run.close()
    raw = acc.attribution(run_dir)
    rows, size = write_chunk_parquet(run_dir)
    assert rows > 0 and size == (run_dir / "chunks.parquet").stat().st_size
    assert not (run_dir / "chunks").exists()
    assert acc.attribution(run_dir).equals(raw)


def test_token_causes_sum_every_category():
    table = acc.attribute(
        acc.connector_requests(_empty_spans()), _empty_spans(), _empty_spans(), None
    )
    assert table.empty
    sums = acc.token_causes(table)
    assert list(sums.index) == [*acc.CATEGORIES, *acc.EXTERNAL_BY_SOURCE] and (sums == 0).all()


def _empty_spans():
    import pandas as pd

    from testbed.analysis.spans import BASE_COLUMNS

    return pd.DataFrame(columns=[*BASE_COLUMNS, "event", "span_name"])


# ---------------------------------------------------------------------------------------------
# Randomized: the vectorised accounting against a token-by-token reference
# ---------------------------------------------------------------------------------------------


def reference(admission: Admission, chunk_size: int, tp: int) -> dict[str, int]:
    """The contract's rules, token by token, from what the test itself recorded."""
    P, E, L = admission.prompt_tokens, admission.engine_hit_tokens, admission.promised_tokens
    first = []
    for rank in range(tp):
        if rank not in admission.first_failed:
            first.append(E)  # no item although L > 0: failed at E
        elif admission.first_failed[rank] is not None:
            first.append(admission.first_failed[rank])
    X = 0 if L == 0 else max(0, min(min(first, default=E + L), E + L) - E)
    H = admission.server_hit_tokens or 0
    counts = dict.fromkeys(acc.CATEGORIES, 0)

    def chunk_cause(k: int) -> str:
        for j in range(k, -1, -1):
            status = admission.chunk_status[j]
            if status == "hit":
                continue
            if status == "in_flight":
                return "in_flight"
            return "capacity" if admission.committed_before[j] else "cold"
        raise AssertionError("a hit with no miss before it, beyond the server's hit")

    held_here = held_elsewhere = 0
    if admission.route is not None:
        chosen, cached = admission.route
        held_here = cached[chosen]
        held_elsewhere = max((c for i, c in enumerate(cached) if i != chosen), default=0)

    for t in range(P):
        if t < E:
            cause = "engine"
        elif t < E + X:
            cause = "external"
        elif t == P - 1:
            cause = "last_token"
        elif t < E + L:
            cause = "load_failed"
        elif held_here <= t < held_elsewhere:
            cause = "routing"
        elif t >= (P // chunk_size) * chunk_size:
            cause = "partial_chunk"
        elif admission.lookup_status in ("unavailable", "refused"):
            cause = admission.lookup_status
        elif t // chunk_size < H // chunk_size:
            cause = "engine_only"
        else:
            cause = chunk_cause(t // chunk_size)
        counts[cause] += 1
    return counts


@pytest.mark.parametrize("seed", range(4))
def test_random_runs_put_every_token_in_exactly_one_category(tmp_path, seed):
    rng = random.Random(seed)
    routes = random.Random(seed + 1000)
    tp = rng.choice([1, 2])
    run = SyntheticRun(tmp_path / "run", chunk_size=C, tp=tp, mla=rng.random() < 0.3)
    documents = [tuple(f"{d}.{i}" for i in range(rng.randint(0, 6))) for d in range(5)]
    reserved: list[str] = []
    for number in range(60):
        labels = rng.choice(documents)
        prompt = Prompt(labels[: rng.randint(0, len(labels))], tail=rng.randint(0, C - 1))
        if prompt.tokens(C) == 0:
            prompt = Prompt(prompt.labels, tail=1)
        P = prompt.tokens(C)
        engine_hit = rng.choice([0, 0, C // 2 * rng.randint(0, 2 * len(prompt.labels))])
        engine_hit = min(engine_hit, max(P - 1, 0))
        lookup = rng.choice([acc.LOOKUP_UNAVAILABLE, acc.LOOKUP_REFUSED] + [acc.LOOKUP_OK] * 8)
        retrieve = {}
        for rank in range(tp):
            roll = rng.random()
            if roll < 0.1:
                retrieve[rank] = "missing"
            elif roll < 0.3:
                retrieve[rank] = engine_hit + C // 2 * rng.randint(0, 2 * len(prompt.labels))
        store = rng.choice(["commit"] * 6 + ["reserve", "abort", "none"])
        request_id = f"r{number}"
        route = None  # a fleet's decision, drawn apart so that the draws above stay the same
        if routes.random() < 0.7:
            cached = [routes.randint(0, 2 * P) // 16 * 16 for _ in range(routes.randint(2, 4))]
            route = (routes.randrange(len(cached)), cached)
        admission = run.request(
            request_id,
            prompt,
            engine_hit=engine_hit,
            lookup=lookup,
            retrieve=retrieve,
            store=store,
            promised=0 if rng.random() < 0.1 else None,
            route=route,
        )
        assert admission.prompt_tokens == P
        if store == "reserve":
            reserved.append(admission.session_id)
        if reserved and rng.random() < 0.3:
            run.commit(reserved.pop(0), ok=rng.random() < 0.8)
        if rng.random() < 0.3:
            victims = [h for h in chunk_hashes(rng.choice(documents)) if rng.random() < 0.5]
            run.evict(victims, reason=rng.choice(["capacity", "drop"]))
    run_dir = run.close()
    table = acc.attribution(Run(run_dir)).set_index("request_id")
    assert (table[list(acc.CATEGORIES)].sum(axis=1) == table["prompt_tokens"]).all()
    assert (table[list(acc.CATEGORIES)] >= 0).all().all()
    assert table["causes_resolved"].all()
    for request_id, admission in run.admissions.items():
        expected = reference(admission, C, tp)
        got = {name: int(table.loc[request_id, name]) for name in acc.CATEGORIES}
        assert got == expected, (request_id, admission)
    # The runs are varied enough to reach most categories, routing losses among them.
    assert (table[list(acc.CATEGORIES)].sum() > 0).sum() >= 9
    assert table["routing"].sum() > 0


# --- tiers ------------------------------------------------------------------------------------


def test_external_hits_split_by_the_tier_each_chunk_was_matched_in(synthetic):
    run = synthetic()
    run.request("r1", ABC)
    # The server matched chunks 0-1 in L1 and chunk 2 on disk; vLLM held the first chunk.
    run.request("r2", ABC, engine_hit=4, hit_by_source={"host": 8, "disk": 4})
    # A third request's load fails at token 10: its disk hit is cut to 2 tokens.
    run.request("r3", ABC, hit_by_source={"host": 8, "disk": 4}, retrieve={0: 10})
    table = acc.attribution(run.close()).set_index("request_id")
    split = table[list(acc.EXTERNAL_BY_SOURCE)]
    assert split.loc["r2"].to_dict() == {
        "external_host": 4, "external_disk": 4, "external_remote": 0, "external_p2p": 0
    }  # fmt: skip
    assert split.loc["r3", "external_host"] == 8 and split.loc["r3", "external_disk"] == 2
    assert (split.sum(axis=1) == table["external"]).all()
    # A server without tiers says nothing: every external token is L1's.
    assert split.loc["r1"].sum() == 0 and table.loc["r1", "external"] == 0
    sums = acc.token_causes(table.reset_index())
    assert (sums["external_host"], sums["external_disk"]) == (12, 6)


def test_a_chunk_whose_prefetch_was_late_or_failed_is_a_miss_of_its_own_cause(synthetic):
    run = synthetic()
    run.request("r1", ABC)
    run.tier_statuses[ABC.hashes[1]] = "prefetch_timeout"
    run.request("r2", ABC, hit_by_source={"host": 4})
    run.tier_statuses = {ABC.hashes[0]: "tier_read_failed"}
    run.request("r3", ABC)
    table = acc.attribution(run.close())
    # Chunk 2, held but behind the late chunk, follows it.
    assert categories(table, "r2") == abc_tail(external=4, prefetch_timeout=8)
    assert categories(table, "r3") == abc_tail(tier_read_failed=12)


def test_a_store_dropped_under_back_pressure_is_a_store_dropped_miss_not_capacity(synthetic):
    run = synthetic()
    run.request("r1", ABC)
    run.evict(ABC.hashes[0:1], reason="store_dropped")
    run.request("r2", ABC)
    assert categories(acc.attribution(run.close()), "r2") == abc_tail(store_dropped=12)
