"""One request explained in every run of a sweep, or in the run a user names.

A sweep runs the same workload many times (another chunk size, capacity, policy), so a
workload's request id names one request in each of its runs, each with its own story.
:func:`explain_runs` takes a run directory, a sweep directory or a directory of runs, and
returns the request's story in each run that has it, labelled with the run (its id and the
swept keys, :func:`testbed.analysis.source.open_source`), or in the one run ``run`` names
(its id or its label). Oracle runs record no telemetry and are left out, by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from testbed.analysis.explain import Explainer
from testbed.analysis.explain_story import RequestStory
from testbed.analysis.source import open_source


@dataclass(frozen=True)
class RunStory:
    """A request's story in one run."""

    run_id: str
    label: str
    """The run among the others: engine and swept keys (``replay capacity_tokens=4096``)."""
    story: RequestStory

    def __str__(self) -> str:
        return f"== run {self.run_id}: {self.label}\n{self.story}"


@dataclass(frozen=True)
class Explained:
    """The stories found, and the runs where the request was not (or cannot be) explained."""

    stories: tuple[RunStory, ...]
    not_found: tuple[str, ...] = ()
    """``"<run id> (<label>)"`` of measured runs without the request."""
    oracles: tuple[str, ...] = ()
    """Oracle runs (no telemetry to explain from)."""

    def __str__(self) -> str:
        parts = [str(story) for story in self.stories]
        if self.not_found:
            parts.append("not in: " + ", ".join(self.not_found))
        if self.oracles:
            parts.append(
                "oracle runs have no telemetry to explain from: " + ", ".join(self.oracles)
            )
        return "\n\n".join(parts)


def explain_runs(path: Path | str, request_id: str, run: str | None = None) -> Explained:
    """The story of ``request_id`` in each measured run under ``path`` (or in the run ``run``
    names, by id or label). ``LookupError`` when no run has the request, or ``run`` names no
    run of ``path``."""
    source = open_source(path)
    runs = source.runs
    if run is not None:
        chosen = runs[(runs["run_id"] == run) | (runs["label"] == run)]
        if chosen.empty:
            names = ", ".join(f"{r.run_id} ({r.label})" for r in runs.itertuples())
            raise LookupError(f"--run {run!r} is not a run of {source.path}; its runs: {names}")
        runs = chosen
    stories, missing, oracles = [], [], []
    hint = ""
    for row in runs.itertuples():
        name = f"{row.run_id} ({row.label})"
        if row.engine == "oracle":
            oracles.append(name)
            continue
        try:
            story = Explainer(source.run(str(row.run_id))).explain(request_id)
        except LookupError as exc:
            missing.append(name)
            hint = hint or str(exc.args[0]).rpartition(": ")[2].rstrip(")")
            continue
        stories.append(RunStory(str(row.run_id), str(row.label), story))
    if not stories:
        where = "" if run is None else f" in run {run}"
        raise LookupError(
            f"no request {request_id!r}{where} in {source.path}: give vLLM's request id, the "
            "workload's, the session id or the id a client saw"
            + (f" (ids such as {hint})" if hint else "")
            + (f"; oracle runs have no telemetry: {', '.join(oracles)}" if oracles else "")
        )
    return Explained(tuple(stories), tuple(missing), tuple(oracles))
