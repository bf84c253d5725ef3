"""The local stack's supervisor on real processes: a killed Redis comes back with its port and credentials, a crash
loop is given up, a process the stack holds down or stopped itself stays down."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from reprise_cli.redis_server import REDIS_USER, RedisServer
from reprise_cli.servers import ManagedProcess, free_port, wait_until
from reprise_cli.supervise import RestartPolicy, Supervisor, Verdict, WatchState

QUICK = RestartPolicy(first_delay_s=0.05, max_delay_s=0.2, crash_limit=3)


@pytest.fixture
def lines() -> list[str]:
    """What the supervisor said."""
    return []


@pytest.fixture
def supervisor(lines: list[str], tmp_path: Path) -> Iterator[Supervisor]:
    """A running supervisor with short delays; stopped after the test."""
    running = Supervisor(say=lines.append, log_path=tmp_path / "supervisor.log", policy=QUICK, poll_s=0.02)
    running.start()
    yield running
    running.stop()


@pytest.mark.parametrize(
    ("attempt", "delay_s"), [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (6, 16.0), (7, 30.0), (20, 30.0)]
)
def test_backoff_doubles_from_half_a_second_to_thirty(attempt: int, delay_s: float) -> None:
    assert RestartPolicy().delay_s(attempt) == delay_s


@pytest.mark.parametrize(("crashes", "verdict"), [(1, Verdict.RESTART), (4, Verdict.RESTART), (5, Verdict.CRASH_LOOP)])
def test_the_fifth_crash_in_the_window_is_a_crash_loop(crashes: int, verdict: Verdict) -> None:
    assert RestartPolicy().verdict(crashes) is verdict


def test_a_killed_redis_comes_back_on_its_port_with_its_credentials(
    supervisor: Supervisor, lines: list[str], tmp_path: Path
) -> None:
    server = RedisServer(
        port=free_port(), data_dir=tmp_path / "redis", log_path=tmp_path / "redis.log", password="pw-" + "x" * 32
    )
    server.start()
    try:
        supervisor.watch("redis", server)
        assert server.process is not None
        first = server.process.pid
        os.killpg(first, signal.SIGKILL)

        assert wait_until(lambda: server.process is not None and server.process.pid != first, timeout_s=20), lines
        assert wait_until(server.ready, timeout_s=20), lines
        client = redis.Redis(port=server.port, username=REDIS_USER, password=server.password, socket_timeout=2)
        try:
            assert client.set("reprise:after-restart", "1") and client.get("reprise:after-restart") == b"1"
        finally:
            client.close()
        with pytest.raises(redis.AuthenticationError):  # the same ACL: the default user is still off
            redis.Redis(port=server.port, socket_timeout=2).ping()
        assert "supervisor: redis crashed (signal SIGKILL)" in lines[0] and "restart 1 in 0.05 s" in lines[0], lines
        assert wait_until(lambda: "supervisor: redis restarted (restart 1)" in lines, timeout_s=5), lines
        assert (tmp_path / "supervisor.log").read_text().count("supervisor: redis") == 2
    finally:
        supervisor.stop()
        server.stop()


def test_a_crash_loop_is_given_up_after_the_limit(supervisor: Supervisor, lines: list[str], tmp_path: Path) -> None:
    runs = tmp_path / "runs.log"
    command = [sys.executable, "-c", "print('run', flush=True); raise SystemExit(3)"]
    process = ManagedProcess("flaky", command, runs)
    process.start()
    supervisor.watch("flaky", process)

    assert wait_until(lambda: supervisor.state("flaky") is WatchState.GAVE_UP, timeout_s=30), lines
    supervisor.stop()
    assert runs.read_text().count("run") == QUICK.crash_limit  # the first run and 2 restarts, then no more
    assert [line.split(" after ")[0] for line in lines if " s up: restart " in line] == [
        "supervisor: flaky crashed (exit code 3)"
    ] * (QUICK.crash_limit - 1)
    assert lines[-1].startswith("supervisor: flaky crashed (exit code 3) 3 times within 120 s: crash loop"), lines
    assert not process.alive()


def test_a_held_process_and_a_stopped_one_stay_down(supervisor: Supervisor, lines: list[str], tmp_path: Path) -> None:
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    held = ManagedProcess("agent-node-2", sleeper, tmp_path / "held.log")
    stopped = ManagedProcess("orchestrator", sleeper, tmp_path / "stopped.log")
    for process in (held, stopped):
        process.start()
        supervisor.watch(process.name, process)
    first = held.pid

    supervisor.hold("agent-node-2")
    os.killpg(first, signal.SIGKILL)  # as an agent does to itself for a simulated node loss
    stopped.stop()
    told = "supervisor: agent-node-2 exited (signal SIGKILL), held down on purpose: not restarted"
    assert wait_until(lambda: told in lines, timeout_s=10), lines
    supervisor.stop()
    assert held.pid == first and not held.alive() and supervisor.state("agent-node-2") is WatchState.HELD
    assert not stopped.alive() and supervisor.state("orchestrator") is WatchState.RUNNING  # stopped, not crashed
    assert lines == [told]


def test_a_released_process_is_started_again_and_supervised(
    supervisor: Supervisor, lines: list[str], tmp_path: Path
) -> None:
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    node = ManagedProcess("agent-node-3", sleeper, tmp_path / "node.log")
    node.start()
    supervisor.watch(node.name, node)
    first = node.pid
    supervisor.hold(node.name)
    os.killpg(first, signal.SIGKILL)  # the simulated node loss
    assert wait_until(lambda: any("held down on purpose" in line for line in lines), timeout_s=10), lines

    supervisor.release(node.name)  # the node was repaired
    assert wait_until(lambda: node.alive() and node.pid != first, timeout_s=10), lines
    assert supervisor.state(node.name) is WatchState.RUNNING
    second = node.pid
    os.killpg(second, signal.SIGKILL)  # supervised again: a crash now is restarted
    assert wait_until(lambda: node.alive() and node.pid != second, timeout_s=10), lines
    node.stop()
