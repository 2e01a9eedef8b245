"""``explain`` and ``kvtb explain``: a request's lookup, where its tokens went, its first miss."""

from __future__ import annotations

import pytest

from testbed.analysis import attribution as acc
from testbed.analysis.explain import Explainer, explain
from testbed.cli.kvtb import main
from tests.analysis.synthetic import Prompt, SyntheticRun

C = 4
ABC = Prompt(("a", "b", "c"), tail=2)


@pytest.fixture
def story_run(tmp_path):
    """r1 stores ABC; its chunk 1 is evicted by r2's store (of another prompt) for room; r3
    misses it; r4 finds r3's store in flight; r5's load fails on rank 1; r6 cannot reach the
    server; r7 is cold."""
    run = SyntheticRun(tmp_path / "run", chunk_size=C, tp=2)
    run.request("r1", ABC)
    run.request("r2", Prompt(("x",)), evict=ABC.hashes[1:2])
    run.request("r3", ABC, store="reserve")
    run.request("r4", ABC)
    run.commit("synthetic:r3")
    run.request("r5", ABC, retrieve={1: 4})
    run.request("r6", ABC, lookup=acc.LOOKUP_UNAVAILABLE, lookup_error="no reply within 5.0 s")
    run.request("r7", Prompt(("z", "y")))
    return run.close()


def evict_span_ids(run_dir):
    from testbed.analysis.spans import load_spans
    from testbed.core.telemetry import attributes as a

    spans = load_spans(run_dir)
    return list(spans.loc[spans["name"] == a.SERVER_EVICT, "span_id"])


def test_a_capacity_miss_names_the_evict_span_and_the_request_that_stored_the_chunk(story_run):
    story = explain(story_run, "r3")
    miss = story.first_miss
    assert miss is not None and miss.cause == "capacity"
    assert (miss.position, miss.start_token) == (1, 4)
    assert miss.evict_span_id == evict_span_ids(story_run)[0]
    assert miss.evict_cause == "capacity"
    assert (miss.storer_request_id, miss.storer_session_id, miss.storer_workload_request_id) == (
        "r1",
        "synthetic:r1",
        "w-r1",
    )
    text = str(story)
    assert miss.evict_span_id in text and "request r1" in text and "evicted for room" in text
    assert [c.status for c in story.lookup] == ["hit", "absent", "hit"]
    assert [(s.start_token, s.end_token, s.category) for s in story.segments] == [
        (0, 4, "external"),
        (4, 12, "capacity"),
        (12, 13, "partial_chunk"),
        (13, 14, "last_token"),
    ]


def test_a_cold_miss_says_no_earlier_request_stored_the_chunk(story_run):
    story = explain(story_run, "r7")
    assert story.first_miss is not None and story.first_miss.cause == "cold"
    assert "no earlier request stored chunk 0" in story.first_miss.reason
    assert "first stored afterwards by session synthetic:r7" in story.first_miss.reason
    assert story.tokens["cold"] == 7


def test_an_in_flight_miss_names_the_request_whose_store_had_not_committed(story_run):
    miss = explain(story_run, "r4").first_miss
    assert miss is not None and miss.cause == "in_flight" and miss.position == 1
    assert miss.storer_request_id == "r3"
    assert "committed after the lookup" in miss.reason


def test_a_failed_load_gives_the_failed_ranks_and_the_first_failed_token(story_run):
    story = explain(story_run, "r5")
    miss = story.first_miss
    assert miss is not None and miss.cause == "load_failed" and miss.start_token == 4
    assert miss.failed_ranks == {1: 4} and miss.missing_ranks == ()
    assert len(miss.retrieve_span_ids) == 2  # one retrieve per TP rank
    assert "rank 1 failed from token 4" in str(story)
    assert story.external_hit_tokens == 4 and story.tokens["load_failed"] == 8


def test_an_unavailable_lookup_gives_its_error(story_run):
    miss = explain(story_run, "r6").first_miss
    assert miss is not None and miss.cause == "unavailable"
    assert miss.lookup_error == "no reply within 5.0 s"


def test_a_request_is_found_by_any_of_its_ids(story_run):
    explainer = Explainer(story_run)
    assert {explainer.explain(i).request_id for i in ("r3", "w-r3", "synthetic:r3")} == {"r3"}
    with pytest.raises(LookupError, match="no request 'nope'"):
        explainer.explain("nope")


def test_segments_agree_with_the_attribution_for_every_request(story_run):
    explainer = Explainer(story_run)
    for request_id in explainer.attribution["request_id"]:
        story = explainer.explain(request_id)
        by_segment = dict.fromkeys(acc.CATEGORIES, 0)
        for segment in story.segments:
            by_segment[segment.category] += segment.num_tokens
        assert by_segment == story.tokens, request_id
        assert sum(story.tokens.values()) == story.prompt_tokens


def test_kvtb_explain_prints_the_story(story_run, capsys):
    assert main(["explain", str(story_run), "w-r3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("request r3 (workload w-r3")
    assert "first miss: token 4 (chunk 1): capacity" in out
    assert main(["explain", str(story_run), "nope"]) == 2
    assert "no request 'nope'" in capsys.readouterr().err


def test_a_routing_miss_names_the_instance_that_held_the_prefix_and_the_routers_costs(tmp_path):
    run = SyntheticRun(tmp_path / "run", chunk_size=C, tp=1)
    prompt = Prompt(("p", "q", "r"), tail=3)
    # r1: instance 2 held 10 tokens of the prompt when it arrived; it went to instance 0 (6
    # held) and the cache server has none of it: tokens [6, 10) were computed though held
    # elsewhere. r2: the chosen instance held nothing: its first miss is the routing one.
    run.request("r1", prompt, route=(0, [6, 4, 10]), store="none")
    run.request("r2", Prompt(("s", "t"), tail=1), route=(1, [8, 0]))
    run_dir = run.close()
    story = explain(run_dir, "r1")
    assert story.route is not None and story.route.instance == 0
    assert [(s.start_token, s.end_token, s.category) for s in story.segments] == [
        (0, 6, "cold"),
        (6, 10, "routing"),
        (10, 12, "cold"),
        (12, 14, "partial_chunk"),
        (14, 15, "last_token"),
    ]
    assert acc.attribution(run_dir).set_index("request_id").loc["r1", "routing"] == 4
    assert "routed by synthetic to instance 0" in str(story)
    miss = explain(run_dir, "r2").first_miss
    assert miss is not None and miss.cause == "routing" and miss.holder_instance == 0
    assert miss.start_token == 0 and "instance 0's prefix cache held" in miss.reason
