"""Orchestrator test fixtures: the app on the real NATS and Redis of the shared fixtures, with an admin key; the
checkpoint registry as a process."""

from __future__ import annotations

import secrets
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from reprise_cli.redis_server import RedisServer
from reprise_cli.servers import ManagedProcess, NatsServer, answers, free_port, wait_until, with_port_retries
from reprise_orchestrator.app import create_app
from reprise_orchestrator.settings import OrchestratorSettings

AdminClient = Callable[..., AbstractContextManager[TestClient]]


@pytest.fixture
def admin_client(redis_server: RedisServer, tmp_path: Path) -> AdminClient:
    """Opens the orchestrator app on a given nats-server, the test's Redis and a SQLite file of its own, as a client
    that sends a fresh admin key; keyword arguments are further settings."""

    @contextmanager
    def open_client(nats_url: str, **settings: Any) -> Iterator[TestClient]:
        key = secrets.token_urlsafe(32)
        app = create_app(
            OrchestratorSettings(
                nats_url=nats_url,
                redis_url=redis_server.url,
                database_url=f"sqlite:///{tmp_path / 'o.db'}",
                admin_api_key=key,
                **settings,
            )
        )
        with TestClient(app, headers={"Authorization": f"Bearer {key}"}) as client:
            yield client

    return open_client


@pytest.fixture
def registry(nats_server: NatsServer, tmp_path: Path) -> Iterator[str]:
    """The checkpoint registry as a process on a free port (another when that one is taken first); its URL."""
    started: list[ManagedProcess] = []

    def launch() -> str:
        port = free_port()
        env = {
            "REPRISE_NATS_URL": nats_server.url,
            "REPRISE_HTTP_HOST": "127.0.0.1",
            "REPRISE_HTTP_PORT": str(port),
            "REPRISE_STATE_DIR": str(tmp_path / "registry"),
            "REPRISE_DATABASE_URL": f"sqlite:///{tmp_path / 'r.db'}",
        }
        process = ManagedProcess("registry", [sys.executable, "-m", "reprise_registry"], tmp_path / "registry.log", env)
        process.start()
        started.append(process)
        url = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: process.listening(port) and answers(f"{url}/readyz", timeout_s=2), timeout_s=45,
                          interval_s=0.2), process.log_tail()  # fmt: skip
        return url

    try:
        yield with_port_retries(launch)
    finally:
        for process in started:
            process.stop(grace_s=10)
