"""Orchestrator test fixtures: the app on the real NATS and Redis of the shared fixtures, with an admin key."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from reprise_cli.servers import RedisServer
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
