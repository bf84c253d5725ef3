"""Checkpoint paths stay confined: a directory inside the configured roots, every file and marker inside it.

Each test plants a real victim file outside the checkpoint and checks that no request, event or stored row makes
the registry accept, read or delete it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from reprise_cli.servers import NatsServer
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.db import make_engine
from reprise_common.events import CheckpointSaved, DeadLetter, FileDigest
from reprise_registry.app import create_app
from reprise_registry.validation.hashing import hash_bytes

from .conftest import ADMIN_HEADERS, registry_settings, write_files

SECRET = b"not a checkpoint: must survive"


def _victim(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(SECRET)
    return path


def _app(database_url: str, **overrides: Any) -> TestClient:
    return TestClient(create_app(registry_settings(database_url, **overrides)), headers=ADMIN_HEADERS)


@pytest.fixture
def roots(tmp_path: Path) -> Path:
    """The one checkpoint root of the confined registries below."""
    root = tmp_path / "roots"
    root.mkdir()
    return root


@pytest.fixture
def confined(database_url: str, roots: Path) -> Iterator[TestClient]:
    """A registry whose only checkpoint root is `roots`, that deletes expired files and keeps one checkpoint."""
    with _app(
        database_url, checkpoint_roots=[roots], retention_delete_files=True, retention_keep_last=1
    ) as test_client:
        yield test_client


def _begin(client: TestClient, root: Path, *, job_id: str, step: int, **extra: Any) -> Any:
    body = {"job_id": job_id, "step": step, "path": str(root), "world_size": 1, **extra}
    return client.post("/v1/checkpoints", json=body)


def _refused_field(answer: Any) -> list[Any]:
    assert answer.status_code == 422, answer.text
    return list(answer.json()["detail"][0]["loc"])


def _validated(client: TestClient, root: Path, *, job_id: str, step: int, **extra: Any) -> dict[str, Any]:
    """A one-rank checkpoint written under `root`, registered, committed and validated."""
    reports = extra.pop("reports", None) or write_files(root, world_size=1)
    begun = _begin(client, root, job_id=job_id, step=step, **extra)
    assert begun.status_code == 201, begun.text
    checkpoint_id = begun.json()["id"]
    reported = client.put(f"/v1/checkpoints/{checkpoint_id}/ranks/0", json={"files": reports})
    assert reported.status_code == 200, reported.text
    assert client.post(f"/v1/checkpoints/{checkpoint_id}/commit").status_code == 200
    checked = client.post(f"/v1/checkpoints/{checkpoint_id}/validate")
    assert checked.json()["state"] == "validated", checked.text
    return dict(checked.json())


# --- what enters over REST ------------------------------------------------------------------------------------
def test_a_marker_leaving_the_checkpoint_is_refused_and_the_victim_survives(confined: TestClient, roots: Path) -> None:
    victim = _victim(roots / "job-m" / "victim.txt")
    root = roots / "job-m" / "step-1"
    write_files(root, world_size=1)
    for step, marker in enumerate(["../victim.txt", "sub/../../victim.txt", str(victim)], start=1):
        answer = _begin(confined, root, job_id="job-m", step=step, marker=marker)
        assert _refused_field(answer) == ["body", "marker"]
    assert confined.get("/v1/jobs/job-m/checkpoints").json()["count"] == 0
    assert victim.read_bytes() == SECRET


def test_a_file_path_outside_the_checkpoint_is_refused(confined: TestClient, roots: Path) -> None:
    victim = _victim(roots / "job-f" / "victim.txt")
    root = roots / "job-f" / "step-1"
    write_files(root, world_size=1)
    checkpoint_id = _begin(confined, root, job_id="job-f", step=1).json()["id"]
    for path in [str(victim), "../victim.txt", str(root / ".." / "victim.txt"), "/etc/passwd", "a\x00b"]:
        files = [{"path": "rank-00000.pt", "size_bytes": 4096}, {"path": path, "size_bytes": len(SECRET)}]
        answer = confined.put(f"/v1/checkpoints/{checkpoint_id}/ranks/0", json={"files": files})
        assert _refused_field(answer) == ["body", "files", 1, "path"], path
    assert confined.get(f"/v1/checkpoints/{checkpoint_id}/files").json()["count"] == 0
    assert victim.read_bytes() == SECRET


def test_a_symlink_leaving_the_checkpoint_is_refused(confined: TestClient, tmp_path: Path, roots: Path) -> None:
    outside = tmp_path / "outside"
    victim = _victim(outside / "victim.pt")
    root = roots / "job-s" / "step-1"
    write_files(root, world_size=1)
    (root / "link.pt").symlink_to(victim)
    (root / "sub").symlink_to(outside, target_is_directory=True)
    checkpoint_id = _begin(confined, root, job_id="job-s", step=1).json()["id"]
    for path in ["link.pt", "sub/victim.pt", str(root / "link.pt")]:
        answer = confined.put(
            f"/v1/checkpoints/{checkpoint_id}/ranks/0", json={"files": [{"path": path, "size_bytes": 1}]}
        )
        assert _refused_field(answer) == ["body", "files", 0, "path"], path
    assert _refused_field(_begin(confined, root, job_id="job-s", step=2, marker="link.pt")) == ["body", "marker"]
    assert victim.read_bytes() == SECRET


def test_a_checkpoint_path_outside_the_roots_is_refused(confined: TestClient, tmp_path: Path, roots: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (roots / "link").symlink_to(elsewhere, target_is_directory=True)
    (roots / "a-file").write_bytes(b"")
    refused = [
        elsewhere / "step-1",  # outside every root
        roots,  # a root itself is no checkpoint directory
        roots / "link" / "step-1",  # inside only until the symlink is followed
        roots / ".." / "elsewhere" / "step-1",
        roots / "a-file",  # not a directory
        Path("relative/step-1"),
    ]
    for step, path in enumerate(refused):
        assert _refused_field(_begin(confined, path, job_id="job-p", step=step)) == ["body", "path"], path
    assert _begin(confined, roots / "job-p" / "step-9", job_id="job-p", step=9).status_code == 201


def test_validation_does_not_read_through_a_symlink_swapped_in_later(
    confined: TestClient, tmp_path: Path, roots: Path
) -> None:
    root = roots / "job-w" / "step-1"
    (root / "sub").mkdir(parents=True)
    data = os.urandom(8192)
    (root / "sub" / "shard.pt").write_bytes(data)
    (root / "COMMITTED").write_bytes(b"")
    reports = [{"path": "sub/shard.pt", "size_bytes": len(data), "digest": hash_bytes(data)}]
    checkpoint = _validated(confined, root, job_id="job-w", step=1, reports=reports)
    outside = tmp_path / "outside"  # the same bytes outside: following the link would find them intact
    outside.mkdir()
    (outside / "shard.pt").write_bytes(data)
    shutil.rmtree(root / "sub")
    (root / "sub").symlink_to(outside, target_is_directory=True)
    checked = confined.post(f"/v1/checkpoints/{checkpoint['id']}/validate").json()
    assert checked["state"] == "corrupt" and checked["reason"].startswith("outside_checkpoint: sub/shard.pt")
    assert confined.get("/v1/jobs/job-w/checkpoints/latest").status_code == 404


# --- retention ------------------------------------------------------------------------------------------------
def test_the_body_cannot_turn_file_deletion_on(client: TestClient, tmp_path: Path) -> None:
    made = [_validated(client, tmp_path / "job-b" / f"step-{step}", job_id="job-b", step=step) for step in (1, 2)]
    answer = client.post("/v1/jobs/job-b/retention", json={"keep_last": 1, "delete_files": True})
    assert _refused_field(answer) == ["body", "delete_files"]  # the service's setting is false
    for checkpoint in made:
        assert client.get(f"/v1/checkpoints/{checkpoint['id']}").json()["state"] == "validated"
        assert (Path(checkpoint["path"]) / "rank-00000.pt").exists()


def test_retention_never_deletes_outside_the_checkpoint_even_from_a_stored_row(
    confined: TestClient, database_url: str, tmp_path: Path, roots: Path
) -> None:
    victim = _victim(roots / "job-d" / "victim.txt")
    outside = tmp_path / "outside"
    outside_victim = _victim(outside / "rank-00000.pt")
    made = [_validated(confined, roots / "job-d" / f"step-{step}", job_id="job-d", step=step) for step in range(1, 5)]
    bad_marker, bad_file, bad_path, _newest = (c["id"] for c in made)
    engine = make_engine(database_url)  # rows as a registry before confinement could have stored them
    with engine.begin() as connection:
        connection.execute(text("UPDATE checkpoints SET marker = '../victim.txt' WHERE id = :id"), {"id": bad_marker})
        connection.execute(
            text("UPDATE checkpoint_files SET path = '../victim.txt' WHERE checkpoint_id = :id"), {"id": bad_file}
        )
        connection.execute(
            text("UPDATE checkpoints SET path = :path WHERE id = :id"), {"path": str(outside), "id": bad_path}
        )
    engine.dispose()
    result = confined.post("/v1/jobs/job-d/retention").json()  # the service's own policy: keep 1, delete files
    assert sorted(result["deleted"]) == sorted([bad_marker, bad_file, bad_path])
    assert victim.read_bytes() == SECRET and outside_victim.read_bytes() == SECRET
    assert len(result["errors"]) == 3 and all("outside" in error for error in result["errors"])
    assert not (roots / "job-d" / "step-1" / "rank-00000.pt").exists()  # what lies inside is still removed
    assert not (roots / "job-d" / "step-2" / "COMMITTED").exists()


def test_retention_does_not_follow_a_directory_symlink_swapped_in_later(
    confined: TestClient, tmp_path: Path, roots: Path
) -> None:
    root = roots / "job-l" / "step-1"
    (root / "sub").mkdir(parents=True)
    data = os.urandom(4096)
    (root / "sub" / "shard.pt").write_bytes(data)
    (root / "COMMITTED").write_bytes(b"")
    reports = [{"path": "sub/shard.pt", "size_bytes": len(data), "digest": hash_bytes(data)}]
    old = _validated(confined, root, job_id="job-l", step=1, reports=reports)
    _validated(confined, roots / "job-l" / "step-2", job_id="job-l", step=2)
    victim = _victim(tmp_path / "outside" / "shard.pt")
    shutil.rmtree(root / "sub")
    (root / "sub").symlink_to(victim.parent, target_is_directory=True)
    result = confined.post("/v1/jobs/job-l/retention").json()
    assert victim.read_bytes() == SECRET
    assert result["deleted"] == [old["id"]] and len(result["errors"]) == 1
    assert not (root / "COMMITTED").exists()


# --- what enters over NATS ------------------------------------------------------------------------------------
@pytest.fixture
def nats_confined(
    sqlite_url: str, nats_server: NatsServer, roots: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[TestClient]:
    """A registry consuming agents' events, its roots set the way an operator sets them: in the environment."""
    monkeypatch.setenv("REPRISE_CHECKPOINT_ROOTS", json.dumps([str(roots)]))
    with _app(sqlite_url, nats_url=nats_server.url, consume_agent_events=True) as test_client:
        yield test_client


def _saved(job_id: str, root: Path, files: list[Path]) -> tuple[str, CheckpointSaved]:
    digests = [FileDigest(path=str(f), size_bytes=f.stat().st_size, digest=hash_bytes(f.read_bytes())) for f in files]
    event = CheckpointSaved(
        source="node-a", node_id="node-a", job_id=job_id, rank=0, step=1, path=str(root), world_size=1,
        files=[str(f) for f in files], file_digests=digests,
    )  # fmt: skip
    return subjects.node_event("node-a", "checkpoint.saved"), event


def _publish_and_read_dead_letters(url: str, events: list[tuple[str, CheckpointSaved]], count: int) -> list[str]:
    async def run() -> list[str]:
        bus = Bus(url=url, service="test-agent")
        await bus.connect(attempts=20)
        for subject, event in events:
            await bus.publish(subject, event)
        sub = await bus.js.subscribe(
            subjects.DEAD_LETTERS_ALL, stream=subjects.DEAD_LETTER_STREAM, ordered_consumer=True
        )
        reasons: list[str] = []
        deadline = time.monotonic() + 15
        while len(reasons) < count and time.monotonic() < deadline:
            try:
                msg = await sub.next_msg(timeout=0.5)
            except TimeoutError:
                continue
            reasons.append(DeadLetter.model_validate_json(msg.data).reason)
        await bus.close()
        return reasons

    return asyncio.run(run())


def test_a_saved_event_leaving_the_roots_is_dead_lettered(
    nats_confined: TestClient, nats_server: NatsServer, tmp_path: Path, roots: Path
) -> None:
    outside = tmp_path / "elsewhere" / "step-1"
    write_files(outside, world_size=1)
    victim = _victim(tmp_path / "victim.pt")
    escaping = roots / "job-e" / "step-1"
    write_files(escaping, world_size=1)
    (escaping / "link.pt").symlink_to(victim)
    good = roots / "job-g" / "step-1"
    write_files(good, world_size=1)
    events = [
        _saved("job-o", outside, [outside / "rank-00000.pt"]),  # the checkpoint directory is outside the roots
        _saved("job-e", escaping, [escaping / "rank-00000.pt", escaping / "link.pt"]),  # a file links outside
        _saved("job-g", good, [good / "rank-00000.pt"]),
    ]
    reasons = _publish_and_read_dead_letters(nats_server.url, events, count=2)
    assert len(reasons) == 2 and all(r.startswith("unusable: checkpoint report refused") for r in reasons), reasons
    assert {r.split("refused: ", 1)[1].split(":")[0] for r in reasons} == {"path", "files[1]"}
    deadline = time.monotonic() + 15
    while nats_confined.get("/v1/jobs/job-g/checkpoints").json()["count"] == 0:  # the consumer kept working
        assert time.monotonic() < deadline, "the good event was not registered"
        time.sleep(0.05)
    for job_id in ("job-o", "job-e"):
        assert nats_confined.get(f"/v1/jobs/{job_id}/checkpoints").json()["count"] == 0
    assert victim.read_bytes() == SECRET
