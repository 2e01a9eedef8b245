"""Which tests one pytest-xdist worker runs together (``make test``: ``--dist loadgroup``).

- ``small-sweep``: the tests that read the session's small sweep (``tests/conftest.py``), so
  that it is made once;
- ``vllm-servers``: the tests that start real vLLM OpenAI servers, one after another, never
  two at once (each server's engine core is busy while it starts);
- ``readme``: the README's and the docs' blocks, which run in one scratch directory in order
  (the docs' pages read the runs the README's demo made).
- ``install``: the tests that build a wheel from the checkout (module-scoped: two workers
  building at once would race on the checkout's ``build/`` directory).

A group is named by path prefixes of test ids, since the controller, which assigns the work,
sees only the ids (pytest-xdist's own ``xdist_group`` mark renames the ids, which pytest 9 no
longer lets it do). The groups' tests come first in the collection, so that the longest work
starts at once.
"""

from __future__ import annotations

GROUPS: dict[str, tuple[str, ...]] = {
    "vllm-servers": ("tests/engine/test_serve",),
    "readme": ("tests/test_readme.py",),
    "install": ("tests/core/test_install.py",),
    "small-sweep": (
        "tests/notebooks/",
        "tests/analysis/test_figure_rules.py",
        "tests/analysis/test_explain_runs.py",
        "tests/core/test_columnar_spans.py",
    ),
}


def group_of(nodeid: str) -> str | None:
    return next((name for name, prefixes in GROUPS.items() if nodeid.startswith(prefixes)), None)


def make_scheduler(config, log):  # type: ignore[no-untyped-def]
    """pytest-xdist's load-group scheduling with the groups above."""
    from xdist.scheduler import LoadGroupScheduling

    class PathGroups(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid) or super()._split_scope(nodeid)

    return PathGroups(config, log)
