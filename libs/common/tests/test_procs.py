"""Process helpers read the kernel's view of a process (state and CPU time) and tie a child to its parent."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from reprise_common.procs import process_alive, sample_process, signal_group, start_ticks

# A parent that starts a sleeping child from a thread (as the launcher's supervisor does), prints its pid, sleeps.
PARENT = """
import subprocess, sys, threading, time
from reprise_common.procs import die_with_parent

def spawn():
    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], preexec_fn=die_with_parent())
    print(child.pid, flush=True)
    time.sleep(60)

threading.Thread(target=spawn).start()
"""


def _state_becomes(pid: int, state: str, *, min_cpu_s: float = 0.0, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sample = sample_process(pid)
        if sample is not None and sample.state == state and sample.cpu_s >= min_cpu_s:
            return True
        time.sleep(0.02)
    return False


def test_a_sample_tells_a_stopped_process_from_a_sleeping_one_and_counts_cpu() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; sum(range(20_000_000)); time.sleep(60)"])
    try:
        assert _state_becomes(child.pid, "S", min_cpu_s=0.1)  # done spinning (its CPU time counted), now asleep
        os.kill(child.pid, signal.SIGSTOP)
        assert _state_becomes(child.pid, "T")
        os.kill(child.pid, signal.SIGCONT)
        assert _state_becomes(child.pid, "S")
    finally:
        child.kill()
        child.wait()
    assert sample_process(child.pid) is None and not process_alive(child.pid)


def test_a_child_started_from_a_thread_dies_with_its_parent() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        assert process_alive(child)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 20
        while process_alive(child) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not process_alive(child)
    finally:
        if process_alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_group_is_signalled_only_while_its_pid_still_names_the_process_recorded() -> None:
    # pids are reused: a group id written down earlier may name a later process's group. That one must survive.
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        started = start_ticks(stranger.pid)
        assert started is not None
        signal_group(stranger.pid, started - 1, signal.SIGKILL)  # recorded for an earlier process of that pid
        signal_group(stranger.pid, None, signal.SIGKILL)  # recorded without a start time: proves nothing
        time.sleep(0.2)
        assert stranger.poll() is None
        signal_group(stranger.pid, started, signal.SIGKILL)  # the recorded process itself
        assert stranger.wait(timeout=10) == -signal.SIGKILL
    finally:
        stranger.kill()
        stranger.wait()


def test_a_group_whose_leader_has_gone_is_still_signalled() -> None:
    # The leader exited and was reaped; a member of its group lives on (no process has the leader's pid now).
    leader = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys; print(subprocess.Popen([sys.executable, '-c', "
         "'import time; time.sleep(60)']).pid, flush=True)"],
        start_new_session=True, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    started = start_ticks(leader.pid)
    assert leader.stdout is not None
    member = int(leader.stdout.readline())
    leader.wait(timeout=10)
    try:
        assert process_alive(member)
        signal_group(leader.pid, started, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while process_alive(member) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not process_alive(member)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)
