"""finished_sending in finishing order: vLLM frees delayed blocks in the order it iterates
the set, so a hash-ordered set (vLLM suffixes request ids with random hex) would make its
prefix cache evict differently from run to run."""

from __future__ import annotations

import pickle

from connector.ops import FinishingOrder


def test_it_iterates_in_the_order_given_whatever_the_hashes():
    ids = [f"req-{n}-{suffix}" for n, suffix in enumerate(["9f3a", "01bc", "77d0", "c4e2", "5a5a"])]
    for order in (ids, ids[::-1], ids[2:] + ids[:2]):
        finished = FinishingOrder(order)
        assert list(finished) == order
        assert finished == set(order) and isinstance(finished, set)
        assert list(pickle.loads(pickle.dumps(finished))) == order  # across vLLM's processes


def test_it_stays_a_set_for_what_vllm_does_with_it():
    finished = FinishingOrder(["b", "a", "b"])
    assert list(finished) == ["b", "a"] and len(finished) == 2 and "a" in finished
    assert not FinishingOrder() and (FinishingOrder() or None) is None
    finished.discard("b")
    finished.add("c")  # vLLM adds nothing; if something did, it would still be seen
    assert list(finished) == ["a", "c"]
