"""Chaos: the registry's PostgreSQL database becomes unavailable (connections refused, live ones terminated), then
comes back.

What must hold: while it is away, every route answers 503 naming the database (never a 500), readiness says so, and
nothing is half-written; when it is back, the same registry answers again without a restart.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from fastapi.testclient import TestClient

from reprise_registry.app import create_app
from reprise_registry.settings import RegistrySettings

pytestmark = pytest.mark.chaos
KEY = secrets.token_urlsafe(32)


def _admin(url: str) -> psycopg.Connection:
    return psycopg.connect(url.rsplit("/", 1)[0] + "/postgres", autocommit=True)


def _take_away(url: str, *, away: bool) -> None:
    name = url.rsplit("/", 1)[1]
    with _admin(url) as admin:
        admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {"false" if away else "true"}')
        if away:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))


@pytest.fixture
def registry(postgres_url: str, tmp_path: Path) -> Iterator[TestClient]:
    settings = RegistrySettings(
        database_url=postgres_url.replace("postgresql://", "postgresql+psycopg://"),
        nats_url="nats://127.0.0.1:1",
        consume_agent_events=False,
        validate_interval_s=3600.0,
        retention_interval_s=3600.0,
        admin_api_key=KEY,
        checkpoint_roots=[tmp_path],
        log_format="text",
    )
    with TestClient(create_app(settings), headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client
    _take_away(postgres_url, away=False)  # whatever the test left, the database can be dropped


def _validated(client: TestClient, root: Path) -> int:
    root.mkdir(parents=True)
    data = b"weights" * 100
    (root / "rank-00000.pt").write_bytes(data)
    (root / "COMMITTED").write_bytes(b"")
    begun = client.post("/v1/checkpoints", json={"job_id": "job-d", "step": 10, "path": str(root), "world_size": 1})
    checkpoint_id = int(begun.json()["id"])
    digest = hashlib.sha256(data).hexdigest()
    files = [{"path": "rank-00000.pt", "size_bytes": len(data), "digest": digest, "algorithm": "sha256"}]
    client.put(f"/v1/checkpoints/{checkpoint_id}/ranks/0", json={"files": files}).raise_for_status()
    client.post(f"/v1/checkpoints/{checkpoint_id}/commit").raise_for_status()
    assert client.post(f"/v1/checkpoints/{checkpoint_id}/validate").json()["state"] == "validated"
    return checkpoint_id


def test_the_registrys_database_away_is_a_503_naming_it_and_back_without_a_restart(
    registry: TestClient, postgres_url: str, tmp_path: Path
) -> None:
    checkpoint_id = _validated(registry, tmp_path / "step-10")
    _take_away(postgres_url, away=True)

    calls = [
        ("GET", "/v1/jobs/job-d/checkpoints/latest"),
        ("GET", f"/v1/checkpoints/{checkpoint_id}"),
        ("POST", "/v1/jobs/job-d/restore-point"),
        ("POST", f"/v1/checkpoints/{checkpoint_id}/load-failed"),
        ("POST", "/v1/checkpoints"),
    ]
    bodies = {"/v1/checkpoints": {"job_id": "job-d", "step": 20, "path": str(tmp_path / "step-20"), "world_size": 1}}
    for method, path in calls:
        answer = registry.request(method, path, json=bodies.get(path, {"reason": "x"}))
        assert answer.status_code == 503, (method, path, answer.status_code, answer.text)
        assert "database" in answer.json()["detail"], answer.text
    ready = registry.get("/readyz")
    assert ready.status_code == 503 and ready.json()["checks"]["database"] == "down"

    _take_away(postgres_url, away=False)
    deadline = time.monotonic() + 15
    while (latest := registry.get("/v1/jobs/job-d/checkpoints/latest")).status_code != 200:
        assert time.monotonic() < deadline, latest.text
        time.sleep(0.2)
    assert latest.json()["id"] == checkpoint_id and latest.json()["load_failed_at"] is None  # nothing half-written
    assert registry.get("/v1/jobs/job-d/checkpoints").json()["count"] == 1
