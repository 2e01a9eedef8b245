"""What vLLM's scheduler itself recorded per request, collected by wrapping the replay's calls.

Tests hold the attribution read from the telemetry against it: a record that passes through
neither the connector's spans nor ``testbed.analysis.attribution``. Per request, at its first
admission: vLLM's own prefix-cache hit and the external tokens the connector promised
(``PrefillStats``), the tokens it had not to compute when it first ran (``num_computed_tokens``
in the scheduler output), and, when a load failed, where vLLM cut it: the scheduler sets the
request's computed tokens back to the start of its first block that failed to load and
recomputes from there (``Scheduler._update_requests_with_invalid_blocks``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import pandas as pd
from vllm.v1.core.sched.scheduler import Scheduler

from testbed.engine.instance import ReplayInstance


@dataclass
class VllmSaw:
    local: dict[str, int] = field(default_factory=dict)
    """vLLM's own prefix-cache hit at first admission."""
    promised: dict[str, int] = field(default_factory=dict)
    """External tokens vLLM counted at first admission (after it cut a failed load)."""
    first_computed: dict[str, int] = field(default_factory=dict)
    """Tokens already computed when the request was first scheduled."""
    kept_after_failed_load: dict[str, int] = field(default_factory=dict)
    """Computed tokens vLLM kept when a load of the request first failed."""

    def loaded_tokens(self, table: pd.DataFrame) -> pd.Series:
        """Per request of an attribution ``table`` (its ``request_id``, and the ``E`` and ``L``
        the connector reported), the external tokens vLLM kept: all ``L`` it was promised, or
        those before the first block it recomputed after a failed load."""
        local = table["engine_hit_tokens"]
        promised = table["promised_tokens"]
        kept = table["request_id"].map(self.kept_after_failed_load).fillna(local + promised)
        return (kept.clip(upper=local + promised) - local).clip(lower=0).astype("int64")


def observe_vllm(monkeypatch) -> VllmSaw:
    """Wraps the replay's scheduler calls (for the test's duration) to fill a :class:`VllmSaw`."""
    saw = VllmSaw()
    runner_output = ReplayInstance._runner_output

    def recording_runner_output(self, so, outcomes):
        for new in so.scheduled_new_reqs:
            saw.first_computed.setdefault(new.req_id, new.num_computed_tokens)
        return runner_output(self, so, outcomes)

    monkeypatch.setattr(ReplayInstance, "_runner_output", recording_runner_output)
    step = ReplayInstance.step

    def recording_step(self):
        scheduler_update = self.scheduler.update_from_output

        def update_from_output(so, output):
            outputs = scheduler_update(so, output)
            for engine_outputs in outputs.values():
                for out in engine_outputs.outputs:
                    stats = out.prefill_stats
                    if stats is not None and out.request_id not in saw.local:
                        saw.local[out.request_id] = stats.num_local_cached_tokens
                        saw.promised[out.request_id] = stats.num_external_cached_tokens
            return outputs

        self.scheduler.update_from_output = update_from_output
        try:
            return step(self)
        finally:
            del self.scheduler.update_from_output

    monkeypatch.setattr(ReplayInstance, "step", recording_step)
    invalid_blocks = Scheduler._update_requests_with_invalid_blocks

    def recording_invalid_blocks(self, requests: Iterable, *args, **kwargs):
        requests = list(requests)
        affected, *rest = invalid_blocks(self, requests, *args, **kwargs)
        for request in requests:
            if request.request_id in affected:
                saw.kept_after_failed_load.setdefault(
                    request.request_id, request.num_computed_tokens
                )
        return (affected, *rest)

    monkeypatch.setattr(Scheduler, "_update_requests_with_invalid_blocks", recording_invalid_blocks)
    return saw
