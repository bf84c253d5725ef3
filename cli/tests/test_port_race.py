"""A port free_port() chose is taken by another process before the server started on it binds it (the CI flake of
"address already in use" in fixture setup): each launcher sees its process lose the port, chooses another and starts
again. The race is made to happen every time: the first port free_port() hands out is one the test already serves
on, with an HTTP server that answers 200 to everything (so only a launcher that checks the port is its own process's
is not fooled)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread

import pytest
import redis

from reprise_cli import ports, redis_server, servers
from reprise_cli.redis_server import RedisServer
from reprise_cli.servers import (
    ManagedProcess,
    NatsServer,
    PortTaken,
    answers,
    free_port,
    free_stack_ports,
    wait_until,
    with_port_retries,
)
from reprise_cli.stack import Stack
from reprise_cli.topology import DEFAULT_PORTS, StackConfig
from reprise_common.errors import ConfigError


class _Ok(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()

    def log_message(self, *_args: object) -> None:
        pass


@contextmanager
def _impostor(port: int = 0) -> Iterator[int]:
    """Another process's server (here a thread's) on `port` (0: one the kernel picks), answering 200 to any GET."""
    server = ThreadingHTTPServer(("127.0.0.1", port), _Ok)
    thread = Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def taken(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """A port the impostor serves on, which free_port() hands out first, as if it were taken just after it was
    chosen; later calls choose as before."""
    real = ports.free_port
    with _impostor() as port:
        handed = iter([port])

        def first_taken(host: str = "127.0.0.1", *, run: int = 1) -> int:
            return next(handed, None) or real(host, run=run)

        monkeypatch.setattr(ports, "free_port", first_taken)
        monkeypatch.setattr(servers, "free_port", first_taken)
        monkeypatch.setattr(redis_server, "free_port", first_taken)
        yield port


def test_no_connection_this_host_opens_can_take_a_port_chosen_for_a_stack() -> None:
    """A Slurm allocation's agents bind the ports the stack chose for them tens of seconds later (the CI flake of a job
    left pending: the second agent's port had become an outgoing connection's source port). Source ports come from the
    kernel's ephemeral range, and the orchestrator draws rendezvous ports from 29500 up: no chosen port is in either."""
    ephemeral = ports.ephemeral_ports()
    for _ in range(50):
        chosen = free_stack_ports(DEFAULT_PORTS)
        agents = range(chosen["agent"], chosen["agent"] + 8)
        for port in {*chosen.values(), *agents}:
            assert port not in ephemeral and not 29_500 <= port < 30_500, (port, chosen)
        assert all(ports.port_is_free(port) for port in agents)


def test_a_nats_server_whose_port_was_taken_starts_on_another(taken: int, tmp_path: Path) -> None:
    server = NatsServer.start_on_free_ports(tmp_path)
    try:
        assert server.port != taken and server.ready()
        assert server.process is not None and server.process.listening(server.port, server.monitor_port)
        assert "address already in use" in (tmp_path / "nats.log").read_text()  # the first try lost the port
    finally:
        server.stop()


def test_a_redis_server_whose_port_was_taken_starts_on_another(taken: int, tmp_path: Path) -> None:
    server = RedisServer.start_on_free_port(tmp_path)
    try:
        assert server.port != taken
        client = redis.Redis(port=server.port, socket_timeout=2)
        try:
            assert client.set("reprise:k", "v") and client.get("reprise:k") == b"v"
        finally:
            client.close()
        assert "address already in use" in (tmp_path / "redis.log").read_text().lower()
    finally:
        server.stop()


def test_a_service_process_whose_port_was_taken_is_started_on_another(taken: int, tmp_path: Path) -> None:
    """As the fixtures start the platform's HTTP services: a process on a free port, ready once it answers on it."""
    started: list[ManagedProcess] = []

    def launch() -> int:
        port = servers.free_port()
        argv = [sys.executable, "-m", "reprise_cli.slack_receiver", "--host", "127.0.0.1", "--port", str(port),
                "--log", str(tmp_path / "messages.jsonl")]  # fmt: skip
        process = ManagedProcess("slack-receiver", argv, tmp_path / "receiver.log")
        process.start()
        started.append(process)
        url = f"http://127.0.0.1:{port}/healthz"
        assert wait_until(lambda: process.listening(port) and answers(url), timeout_s=30), process.log_tail()
        return port

    try:
        port = with_port_retries(launch)
        assert port != taken and len(started) == 2
        assert not started[0].alive() and started[1].alive()
    finally:
        for process in started:
            process.stop()


def test_a_process_that_ends_for_another_reason_did_not_lose_its_port(tmp_path: Path) -> None:
    process = ManagedProcess("fails", [sys.executable, "-c", "raise SystemExit('bad setting')"], tmp_path / "f.log")
    process.start()
    try:
        assert wait_until(lambda: not process.alive(), timeout_s=10)
        with pytest.raises(ConfigError, match="fails exited during start: bad setting") as exited:
            process.listening(free_port())
        assert not isinstance(exited.value, PortTaken)
    finally:
        process.stop()


def test_a_port_taken_on_every_try_gives_up_after_three() -> None:
    tries = []

    def launch() -> None:
        tries.append(1)
        raise PortTaken("port 1 of x was taken by another process", port=1)

    with pytest.raises(PortTaken):
        with_port_retries(launch)
    assert len(tries) == 3


def test_reprise_up_names_the_flag_of_a_port_in_use(tmp_path: Path) -> None:
    with _impostor() as port:
        chosen = {**free_stack_ports(DEFAULT_PORTS), "orchestrator": port}  # as if passed to `reprise up`
        stack = Stack(StackConfig(nodes=1, spares=0, state_dir=tmp_path / "state", ports=chosen))
        with pytest.raises(ConfigError, match=f"port {port} for orchestrator is already in use: stop what uses it "
                                              "or pass --orchestrator-port <other port>"):  # fmt: skip
            stack.start()
        assert stack.pids() == []  # refused before anything started


@pytest.mark.stack
def test_a_stack_on_free_ports_moves_off_a_port_taken_after_it_was_chosen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The orchestrator's port is served by another process between the stack's port check and the orchestrator's
    bind: the stack starts again on other ports, and its URLs are those of the processes that run."""
    said: list[str] = []
    stack = Stack(StackConfig(nodes=1, spares=0, state_dir=tmp_path / "state"), say=said.append, free_ports=True)
    preflight, held, impostors = stack.preflight, [], ExitStack()

    def preflight_then_take() -> None:
        preflight()
        if not held:
            held.append(stack.config.ports["orchestrator"])
            impostors.enter_context(_impostor(held[0]))

    monkeypatch.setattr(stack, "preflight", preflight_then_take)
    try:
        stack.start(timeout_s=90)
        orchestrator, port = stack.services["orchestrator"], stack.config.ports["orchestrator"]
        assert port != held[0] and stack.url("orchestrator") == f"http://127.0.0.1:{port}"
        assert orchestrator.alive() and orchestrator.listening(port)
        assert any(f"port {held[0]} of orchestrator was taken" in line for line in said), said
        dashboard = next(spec for spec in stack.specs if spec.name == "dashboard")
        assert dashboard.env["REPRISE_ORCHESTRATOR_URL"] == stack.url("orchestrator")  # dependents: the final port
    finally:
        stack.stop()
        impostors.close()
