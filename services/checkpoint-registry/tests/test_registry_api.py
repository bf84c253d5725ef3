"""The registry's REST API on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlmodel import Session

from reprise_registry.app import create_app
from reprise_registry.models import Checkpoint, CheckpointState
from reprise_registry.settings import RegistrySettings


@pytest.fixture
def client(database_url: str) -> Iterator[TestClient]:
    app = create_app(RegistrySettings(database_url=database_url))
    with TestClient(app) as test_client:
        yield test_client


def _mark(client: TestClient, checkpoint_id: int, state: CheckpointState) -> None:
    # Validation arrives with the registry issue; until then tests set the state directly in the database.
    with Session(client.app.state.engine) as session:  # type: ignore[attr-defined]
        row = session.get(Checkpoint, checkpoint_id)
        assert row is not None
        row.state = state
        session.add(row)
        session.commit()


def test_latest_is_404_until_a_checkpoint_is_validated(client: TestClient) -> None:
    assert client.get("/v1/jobs/job-a/checkpoints/latest").status_code == 404
    created = client.post("/v1/checkpoints", json={"job_id": "job-a", "step": 100, "path": "/ckpt/100"})
    assert created.status_code == 201
    assert created.json()["state"] == "writing"
    assert client.get("/v1/jobs/job-a/checkpoints/latest").status_code == 404


def test_latest_returns_newest_validated_and_falls_back(client: TestClient) -> None:
    ids = {}
    for step in (100, 200, 300):
        ids[step] = client.post("/v1/checkpoints", json={"job_id": "job-b", "step": step, "path": f"/c/{step}"}).json()[
            "id"
        ]
    _mark(client, ids[100], CheckpointState.VALIDATED)
    _mark(client, ids[200], CheckpointState.VALIDATED)
    _mark(client, ids[300], CheckpointState.CORRUPT)
    latest = client.get("/v1/jobs/job-b/checkpoints/latest").json()
    assert latest["step"] == 200
    older = client.get("/v1/jobs/job-b/checkpoints/latest", params={"before_step": 200}).json()
    assert older["step"] == 100
    assert client.get("/v1/jobs/job-b/checkpoints/latest", params={"before_step": 100}).status_code == 404


def test_bad_checkpoint_is_422_naming_the_field(client: TestClient) -> None:
    response = client.post("/v1/checkpoints", json={"job_id": "bad id!", "step": -1, "path": "/x"})
    assert response.status_code == 422
    fields = {tuple(err["loc"]) for err in response.json()["detail"]}
    assert ("body", "job_id") in fields and ("body", "step") in fields


def test_ops_routes(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["checks"] == {"database": "ok"}
    metrics = client.get("/metrics")
    assert metrics.status_code == 200 and "# TYPE" in metrics.text
