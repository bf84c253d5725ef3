"""Job API validation: a bad spec is refused with 422 naming the field."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from reprise_cli.servers import NatsServer, RedisServer
from reprise_orchestrator.app import create_app
from reprise_orchestrator.settings import OrchestratorSettings


@pytest.fixture
def client(nats_server: NatsServer, redis_server: RedisServer, tmp_path: Path) -> Iterator[TestClient]:
    admin_key = secrets.token_urlsafe(32)
    settings = OrchestratorSettings(
        nats_url=nats_server.url,
        redis_url=redis_server.url,
        database_url=f"sqlite:///{tmp_path / 'o.db'}",
        admin_api_key=admin_key,
    )
    with TestClient(create_app(settings), headers={"Authorization": f"Bearer {admin_key}"}) as test_client:
        yield test_client


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"name": "x", "command": ["true"]}, "body"),  # neither nodes nor node_count
        ({"name": "x", "node_count": 0, "command": ["true"]}, "node_count"),
        ({"name": "x", "node_count": 1, "command": []}, "command"),
        ({"name": "x", "nodes": ["bad node"], "command": ["true"]}, "nodes"),
        ({"name": "", "node_count": 1, "command": ["true"]}, "name"),
        ({"name": "x", "node_count": 1, "ranks_per_node": 0, "command": ["true"]}, "ranks_per_node"),
    ],
)
def test_bad_spec_is_422_naming_the_field(client: TestClient, body: dict[str, object], field: str) -> None:
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 422
    locations = [".".join(str(p) for p in err["loc"]) for err in response.json()["detail"]]
    assert any(field in loc for loc in locations), locations


def test_unknown_nodes_are_a_conflict(client: TestClient) -> None:
    response = client.post("/v1/jobs", json={"name": "x", "nodes": ["node-9"], "command": ["true"]})
    assert response.status_code == 409
    assert "node-9" in response.json()["detail"]


def test_unknown_job_is_404(client: TestClient) -> None:
    assert client.get("/v1/jobs/job-nope").status_code == 404


def test_readiness_names_each_dependency(client: TestClient) -> None:
    body = client.get("/readyz").json()
    assert set(body["checks"]) == {"nats", "redis", "database"}
