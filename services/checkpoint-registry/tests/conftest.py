"""Fixtures of the registry's tests: a running app on a real database, and real checkpoint files on disk."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from reprise_registry.app import create_app
from reprise_registry.settings import RegistrySettings
from reprise_registry.validation.hashing import hash_bytes

WriteCheckpoint = Callable[..., dict[str, Any]]

# The bootstrap admin key every test service accepts without asking the key authority.
ADMIN_KEY = secrets.token_urlsafe(32)
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_KEY}"}


def registry_settings(database_url: str, **overrides: Any) -> RegistrySettings:
    """Settings for a test registry: no NATS consumers unless asked, validation only when asked."""
    values: dict[str, Any] = {
        "database_url": database_url,
        "nats_url": "nats://127.0.0.1:1",  # nothing listens there: NATS stays down unless a test gives a server
        "consume_agent_events": False,
        "validate_interval_s": 3600.0,
        "retention_interval_s": 3600.0,
        "log_format": "text",
        "admin_api_key": ADMIN_KEY,
    }
    values.update(overrides)
    return RegistrySettings(**values)


@pytest.fixture
def client(database_url: str) -> Iterator[TestClient]:
    """The registry app on each SQL backend in turn."""
    with TestClient(create_app(registry_settings(database_url)), headers=ADMIN_HEADERS) as test_client:
        yield test_client


@pytest.fixture
def sqlite_client(sqlite_url: str) -> Iterator[TestClient]:
    """The registry app on SQLite only."""
    with TestClient(create_app(registry_settings(sqlite_url)), headers=ADMIN_HEADERS) as test_client:
        yield test_client


def write_files(root: Path, *, world_size: int, size: int = 4096, seed: int = 0, marker: bool = True) -> list[dict]:
    """Write rank-0000N.pt files of random bytes (and the COMMITTED marker); return each rank's file reports."""
    root.mkdir(parents=True, exist_ok=True)
    reports = []
    for rank in range(world_size):
        data = os.urandom(size + rank + seed)
        (root / f"rank-{rank:05d}.pt").write_bytes(data)
        reports.append({"path": f"rank-{rank:05d}.pt", "size_bytes": len(data), "digest": hash_bytes(data)})
    if marker:
        (root / "COMMITTED").write_bytes(b"")
    return reports


@pytest.fixture
def write_checkpoint(tmp_path: Path) -> WriteCheckpoint:
    """Write a real checkpoint and register it over the API: begin, one report per rank, commit (if asked)."""

    def write(
        client: TestClient, *, job_id: str, step: int, world_size: int = 2, commit: bool = True, marker: bool = True
    ) -> dict[str, Any]:
        root = tmp_path / job_id / f"step-{step}"
        reports = write_files(root, world_size=world_size, marker=marker)
        begun = client.post(
            "/v1/checkpoints", json={"job_id": job_id, "step": step, "path": str(root), "world_size": world_size}
        )
        assert begun.status_code == 201, begun.text
        checkpoint: dict[str, Any] = begun.json()
        for rank, report in enumerate(reports):
            answer = client.put(f"/v1/checkpoints/{checkpoint['id']}/ranks/{rank}", json={"files": [report]})
            assert answer.status_code == 200, answer.text
        if commit:
            committed = client.post(f"/v1/checkpoints/{checkpoint['id']}/commit")
            assert committed.status_code == 200, committed.text
            checkpoint = committed.json()["checkpoint"]
        checkpoint["root"] = root
        return checkpoint

    return write
