"""The kernel's exit events (the proc connector) as launch/kernel_exits.py reads them, from real processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from reprise_agent.launch.kernel_exits import ExitWatch, container_status

THREADS_THEN_EXIT = """
import sys, threading, time
threads = [threading.Thread(target=time.sleep, args=(0.05,)) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
print("threads done", flush=True)
sys.stdin.readline()
sys.exit(7)
"""


@pytest.fixture
def watch() -> Iterator[ExitWatch]:
    opened = ExitWatch.open()
    if opened is None:
        pytest.skip("the kernel does not send its exit events to this process (no CAP_NET_ADMIN)")
    yield opened
    opened.close()


class Told:
    """What the watch told of one process."""

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.event = threading.Event()

    def __call__(self, status: int) -> None:
        self.statuses.append(status)
        self.event.set()


def test_an_exit_code_is_told_as_the_container_status_a_daemon_would_report(watch: ExitWatch) -> None:
    process = subprocess.Popen([sys.executable, "-c", THREADS_THEN_EXIT], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert process.stdout is not None and process.stdin is not None
    told = Told()
    watch.watch(process.pid, told)
    assert process.stdout.readline() == b"threads done\n"  # its other threads exited: no word of those
    assert not told.event.wait(0.3)
    process.stdin.write(b"\n")
    process.stdin.flush()
    assert told.event.wait(10)
    process.wait()
    assert [container_status(s) for s in told.statuses] == [7]


def test_a_signal_death_is_told_as_128_plus_the_signal(watch: ExitWatch) -> None:
    process = subprocess.Popen(["sleep", "30"])
    told = Told()
    watch.watch(process.pid, told)
    process.send_signal(signal.SIGKILL)
    assert told.event.wait(10)
    process.wait()
    assert [container_status(s) for s in told.statuses] == [128 + signal.SIGKILL]


def test_a_process_forgotten_is_not_told(watch: ExitWatch) -> None:
    process = subprocess.Popen(["sleep", "30"])
    told, other = Told(), Told()
    watch.watch(process.pid, told)
    watch.forget(process.pid)
    marker = subprocess.Popen(["sleep", "30"])  # its exit, told after the first's, shows the first's was read
    watch.watch(marker.pid, other)
    process.kill()
    process.wait()
    marker.kill()
    marker.wait()
    assert other.event.wait(10)
    assert told.statuses == []
