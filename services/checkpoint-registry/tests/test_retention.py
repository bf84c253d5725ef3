"""Retention keeps the newest K plus every Nth validated checkpoint, deletes files if allowed, and honours pins."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from reprise_registry.app import create_app

from .conftest import ADMIN_HEADERS, registry_settings

WriteCheckpoint = Callable[..., dict[str, Any]]


@pytest.fixture
def deleting_client(database_url: str) -> Iterator[TestClient]:
    """A registry whose operator lets retention delete files (REPRISE_RETENTION_DELETE_FILES=true)."""
    settings = registry_settings(database_url, retention_delete_files=True)
    with TestClient(create_app(settings), headers=ADMIN_HEADERS) as test_client:
        yield test_client


def _validated(client: TestClient, write_checkpoint: WriteCheckpoint, job_id: str, step: int) -> dict[str, Any]:
    checkpoint = write_checkpoint(client, job_id=job_id, step=step)
    deadline = time.monotonic() + 10
    while client.get(f"/v1/checkpoints/{checkpoint['id']}").json()["state"] != "validated":
        assert time.monotonic() < deadline, "not validated in 10 s"
        time.sleep(0.02)
    return checkpoint


def test_keeps_last_k_and_every_nth_and_never_a_pinned_one(
    deleting_client: TestClient, write_checkpoint: WriteCheckpoint
) -> None:
    client = deleting_client
    made = {step: _validated(client, write_checkpoint, "job-r", step) for step in range(1, 7)}
    pinned = client.post(f"/v1/checkpoints/{made[1]['id']}/pins", json={"holder": "recovery-42"})
    assert pinned.status_code == 201 and pinned.json()["holder"] == "recovery-42"
    policy = {"keep_last": 2, "keep_every": 3, "delete_files": True}
    result = client.post("/v1/jobs/job-r/retention", json=policy).json()
    ids = {step: c["id"] for step, c in made.items()}
    assert sorted(result["deleted"]) == sorted([ids[2], ids[4]])
    assert result["pinned"] == [ids[1]] and sorted(result["kept"]) == sorted([ids[3], ids[5], ids[6]])
    assert result["files_deleted"] == 2 * 3  # two rank files and the marker, each
    for step in (2, 4):
        assert client.get(f"/v1/checkpoints/{ids[step]}").json()["state"] == "deleted"
        assert not made[step]["root"].exists()
    for step in (1, 3, 5, 6):
        assert (made[step]["root"] / "rank-00000.pt").exists()
    assert client.get("/v1/jobs/job-r/checkpoints/latest").json()["step"] == 6
    refused = client.post(f"/v1/checkpoints/{ids[2]}/pins", json={"holder": "late"})
    assert refused.status_code == 409  # a deleted checkpoint cannot be pinned for a restore
    assert client.delete(f"/v1/checkpoints/{ids[1]}/pins/recovery-42").status_code == 204
    again = client.post("/v1/jobs/job-r/retention", json=policy).json()
    assert again["deleted"] == [ids[1]]


def test_an_expired_pin_no_longer_protects(client: TestClient, write_checkpoint: WriteCheckpoint) -> None:
    old = _validated(client, write_checkpoint, "job-e", 1)
    _validated(client, write_checkpoint, "job-e", 2)
    client.post(f"/v1/checkpoints/{old['id']}/pins", json={"holder": "r1", "ttl_s": 0.05})
    time.sleep(0.1)
    result = client.post("/v1/jobs/job-e/retention", json={"keep_last": 1}).json()
    assert result["deleted"] == [old["id"]] and result["files_deleted"] == 0
    assert (old["root"] / "rank-00000.pt").exists()  # files are kept unless delete_files is asked


def test_a_body_can_keep_files_a_deleting_registry_would_remove(
    deleting_client: TestClient, write_checkpoint: WriteCheckpoint
) -> None:
    old = _validated(deleting_client, write_checkpoint, "job-k", 1)
    _validated(deleting_client, write_checkpoint, "job-k", 2)
    result = deleting_client.post("/v1/jobs/job-k/retention", json={"keep_last": 1, "delete_files": False}).json()
    assert result["deleted"] == [old["id"]] and result["files_deleted"] == 0
    assert (old["root"] / "rank-00000.pt").exists()
