"""Stopping a child with everything it started, and SIGTERM as an interrupt
(``testbed/core/process_groups.py``), on real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from testbed.core.process_groups import (
    group_members,
    kill_group,
    sigterm_as_interrupt,
    start_group,
    stop_group,
)

# A leader that starts a child deaf to SIGTERM, says its pid, and exits at once on SIGTERM,
# leaving the child behind (as a vLLM server killed before it stopped its engine core would).
LEADER = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    child = subprocess.Popen([sys.executable, "-c", deaf])
    print(child.pid, flush=True)
    time.sleep(600)
    """
)


def start_leader() -> tuple[subprocess.Popen, int]:
    leader = start_group([sys.executable, "-c", LEADER], stdout=subprocess.PIPE, text=True)
    assert leader.stdout is not None
    return leader, int(leader.stdout.readline())


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_stopping_a_group_stops_the_child_its_leader_left_behind():
    leader, child = start_leader()
    assert os.getpgid(leader.pid) == leader.pid == os.getsid(leader.pid)  # a session of its own
    assert sorted(group_members(leader.pid)) == sorted([leader.pid, child])
    stop_group(leader, timeout_s=30.0, straggler_grace_s=0.5)
    assert leader.returncode == 0  # it stopped as asked; the child needed SIGKILL
    assert not alive(child) and group_members(leader.pid) == []


def test_killing_a_group_kills_every_member_at_once():
    leader, child = start_leader()
    kill_group(leader)
    assert leader.returncode == -signal.SIGKILL
    assert not alive(child) and group_members(leader.pid) == []


def test_sigterm_interrupts_once_and_lets_the_cleanup_it_started_finish():
    previous = signal.getsignal(signal.SIGTERM)
    cleaned = False
    with pytest.raises(KeyboardInterrupt), sigterm_as_interrupt():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # interrupted here
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # a second one, while unwinding: ignored
            time.sleep(0.05)
            cleaned = True
    assert cleaned
    assert signal.getsignal(signal.SIGTERM) is previous
