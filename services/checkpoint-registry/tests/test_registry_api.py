"""The registry's REST API on SQLite and PostgreSQL: register, commit, validate, look up, fall back."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

WriteCheckpoint = Callable[..., dict[str, Any]]


def _settled(client: TestClient, checkpoint_id: int) -> dict:
    """The checkpoint once the registry's own validator (woken by the commit) has decided it."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        checkpoint = client.get(f"/v1/checkpoints/{checkpoint_id}").json()
        if checkpoint["state"] != "committed":
            return checkpoint
        time.sleep(0.02)
    raise AssertionError(f"checkpoint {checkpoint_id} was not validated within 10 s")


def _validate(client: TestClient, checkpoint_id: int, **params: float) -> dict:
    answer = client.post(f"/v1/checkpoints/{checkpoint_id}/validate", params=params)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0x01
    path.write_bytes(bytes(data))


def test_latest_is_404_until_a_checkpoint_is_validated(client: TestClient, write_checkpoint: WriteCheckpoint) -> None:
    assert client.get("/v1/jobs/job-a/checkpoints/latest").status_code == 404
    unfinished = write_checkpoint(client, job_id="job-a", step=200, commit=False)  # every rank, marker, no commit
    checkpoint = write_checkpoint(client, job_id="job-a", step=100)
    assert checkpoint["state"] == "committed"
    assert checkpoint["file_count"] == 2 and checkpoint["manifest_digest"]
    assert _settled(client, checkpoint["id"])["state"] == "validated"  # the commit woke the registry's validator
    latest = client.get("/v1/jobs/job-a/checkpoints/latest").json()
    assert latest["id"] == checkpoint["id"] and latest["step"] == 100 and latest["validated_at"]
    assert client.get(f"/v1/checkpoints/{unfinished['id']}").json()["state"] == "writing"


def test_commit_waits_for_every_rank_and_the_marker(client: TestClient, write_checkpoint: WriteCheckpoint) -> None:
    checkpoint = write_checkpoint(client, job_id="job-c", step=5, world_size=3, commit=False, marker=False)
    root: Path = checkpoint["root"]
    refused = client.post(f"/v1/checkpoints/{checkpoint['id']}/commit")
    assert refused.status_code == 409 and "COMMITTED" in refused.json()["detail"]
    (root / "COMMITTED").write_bytes(b"")
    begun = client.post("/v1/checkpoints", json={"job_id": "job-c", "step": 6, "path": str(root), "world_size": 3})
    files = [{"path": "rank-00000.pt", "size_bytes": (root / "rank-00000.pt").stat().st_size}]
    client.put(f"/v1/checkpoints/{begun.json()['id']}/ranks/0", json={"files": files})
    missing = client.post(f"/v1/checkpoints/{begun.json()['id']}/commit")
    assert missing.status_code == 409 and "missing ranks [1, 2]" in missing.json()["detail"]
    assert client.post(f"/v1/checkpoints/{checkpoint['id']}/commit").json()["committed"] is True


def test_begin_is_idempotent_and_conflicts_are_409(client: TestClient, tmp_path: Path) -> None:
    body = {"job_id": "job-i", "step": 7, "path": str(tmp_path / "c7"), "world_size": 2}
    first = client.post("/v1/checkpoints", json=body).json()
    again = client.post("/v1/checkpoints", json=body).json()
    assert first["id"] == again["id"]
    other = client.post("/v1/checkpoints", json={**body, "path": str(tmp_path / "elsewhere")})
    assert other.status_code == 409
    outside = client.put(
        f"/v1/checkpoints/{first['id']}/ranks/0", json={"files": [{"path": "/etc/passwd", "size_bytes": 1}]}
    )
    assert outside.status_code == 422 and outside.json()["detail"][0]["loc"] == ["body", "files", 0, "path"]
    assert client.put(f"/v1/checkpoints/{first['id']}/ranks/2", json={"files": []}).status_code == 409


def test_a_flipped_byte_makes_it_corrupt_and_never_latest(
    client: TestClient, write_checkpoint: WriteCheckpoint
) -> None:
    good = write_checkpoint(client, job_id="job-f", step=10)
    assert _validate(client, good["id"])["state"] == "validated"
    bad = write_checkpoint(client, job_id="job-f", step=20)
    assert _settled(client, bad["id"])["state"] == "validated"
    _flip_byte(bad["root"] / "rank-00001.pt", 1234)
    outcome = _validate(client, bad["id"])
    assert outcome["state"] == "corrupt" and outcome["reason"].startswith("digest_mismatch: rank-00001.pt")
    assert client.get("/v1/jobs/job-f/checkpoints/latest").json()["step"] == 10


def test_truncated_or_missing_files_are_corrupt_even_when_only_metadata_is_checked(
    client: TestClient, write_checkpoint: WriteCheckpoint
) -> None:
    short = write_checkpoint(client, job_id="job-t", step=1)
    _settled(client, short["id"])
    path = short["root"] / "rank-00000.pt"
    path.write_bytes(path.read_bytes()[:-1])
    outcome = _validate(client, short["id"], sample_fraction=0.0)
    assert outcome["state"] == "corrupt" and outcome["reason"].startswith("size_mismatch")
    gone = write_checkpoint(client, job_id="job-t", step=2)
    _settled(client, gone["id"])
    (gone["root"] / "rank-00001.pt").unlink()
    outcome = _validate(client, gone["id"], sample_fraction=0.0)
    assert outcome["state"] == "corrupt" and outcome["reason"].startswith("missing_file")
    assert client.get("/v1/jobs/job-t/checkpoints/latest").status_code == 404


def test_marker_removed_after_commit_is_corrupt(client: TestClient, write_checkpoint: WriteCheckpoint) -> None:
    checkpoint = write_checkpoint(client, job_id="job-m", step=3)
    _settled(client, checkpoint["id"])
    (checkpoint["root"] / "COMMITTED").unlink()
    outcome = _validate(client, checkpoint["id"])
    assert outcome["state"] == "corrupt" and outcome["reason"].startswith("missing_marker")


def test_load_failure_falls_back_to_the_previous_validated(
    client: TestClient, write_checkpoint: WriteCheckpoint
) -> None:
    ids = {}
    for step in (100, 200, 300):
        ids[step] = write_checkpoint(client, job_id="job-b", step=step)["id"]
        _validate(client, ids[step])
    assert client.get("/v1/jobs/job-b/checkpoints/latest").json()["step"] == 300
    failed = client.post(f"/v1/checkpoints/{ids[300]}/load-failed", json={"reason": "torch.load: bad zip"})
    assert failed.status_code == 200 and failed.json()["load_failure"] == "torch.load: bad zip"
    assert client.get("/v1/jobs/job-b/checkpoints/latest").json()["step"] == 200
    client.post(f"/v1/checkpoints/{ids[200]}/load-failed", json={"reason": "again"})
    assert client.get("/v1/jobs/job-b/checkpoints/latest").json()["step"] == 100
    older = client.get("/v1/jobs/job-b/checkpoints/latest", params={"before_step": 100})
    assert older.status_code == 404


def test_manifest_and_listing(client: TestClient, write_checkpoint: WriteCheckpoint) -> None:
    checkpoint = write_checkpoint(client, job_id="job-l", step=9, world_size=3)
    _settled(client, checkpoint["id"])
    files = client.get(f"/v1/checkpoints/{checkpoint['id']}/files").json()
    assert files["count"] == 3 and [f["rank"] for f in files["data"]] == [0, 1, 2]
    assert all(f["algorithm"] == "blake3" and len(f["digest"]) == 64 for f in files["data"])
    listed = client.get("/v1/jobs/job-l/checkpoints", params={"state": "validated"}).json()
    assert listed["count"] == 1 and listed["data"][0]["id"] == checkpoint["id"]


def test_bad_checkpoint_is_422_naming_the_field(client: TestClient) -> None:
    response = client.post("/v1/checkpoints", json={"job_id": "bad id!", "step": -1, "path": "/x"})
    assert response.status_code == 422
    fields = {tuple(err["loc"]) for err in response.json()["detail"]}
    assert ("body", "job_id") in fields and ("body", "step") in fields


def test_ops_routes(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.json()["checks"]["database"] == "ok"
    assert ready.json()["checks"]["nats"] == "down" and ready.status_code == 503  # no NATS in this test
    metrics = client.get("/metrics")
    assert metrics.status_code == 200 and "# TYPE" in metrics.text
