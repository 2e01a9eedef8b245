"""The connector's stats recorder: one interval per take, nothing when nothing happened."""

from __future__ import annotations

from connector.stats import StatsRecorder, is_empty


def test_each_take_is_the_interval_since_the_last_and_none_when_nothing_happened():
    recorder = StatsRecorder()
    assert recorder.take() is None
    recorder.lookup(requested_tokens=512, hit_tokens=256, ok=True, seconds=0.002)
    recorder.store(nbytes=4096, ok=False, seconds=0.001)
    first = recorder.take()
    assert first is not None and not is_empty(first)
    assert (first["lookups"], first["lookup_hit_tokens"], first["stores"]) == (1, 256, 1)
    assert (first["store_failures"], first["stored_bytes"], first["lookup_s"]) == (1, 4096, [0.002])
    assert recorder.take() is None  # taken: the next interval starts empty
    recorder.abandoned_release()
    second = recorder.take()
    assert second is not None and second["abandoned_releases"] == 1 and second["lookups"] == 0
    recorder.retrieve(nbytes=8, ok=True, seconds=0.5)
    third = recorder.take()
    assert third is not None and third["retrieved_bytes"] == 8 and third["retrieve_s"] == [0.5]
