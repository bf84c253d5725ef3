"""A checkpoint.saved event may name its own commit marker (a checkpoint the script wrote itself, reported by the
agent): it commits only once that file exists, and a marker that leaves the checkpoint's directory is refused before
anything is stored (real nats-server, real SQLite)."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from reprise_cli.servers import NatsServer
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.events import CheckpointSaved, FileDigest
from reprise_registry.app import create_app

from .conftest import ADMIN_HEADERS, registry_settings


@pytest.fixture
def nats_client(sqlite_url: str, nats_server: NatsServer) -> Iterator[TestClient]:
    settings = registry_settings(sqlite_url, nats_url=nats_server.url, consume_agent_events=True)
    with TestClient(create_app(settings), headers=ADMIN_HEADERS) as client:
        yield client


def _publish(url: str, events: list[CheckpointSaved]) -> None:
    async def run() -> None:
        bus = Bus(url=url, service="test-agent")
        await bus.connect(attempts=20)
        for event in events:
            await bus.publish(subjects.node_event("n1", "checkpoint.saved"), event)
        await bus.close()

    asyncio.run(run())


def _snapshot(directory: Path, step: int, *, marker: str | None = None) -> CheckpointSaved:
    data = bytes(range(256)) * (step + 1)
    name = f"snapshot-{step}.pt"
    (directory / name).write_bytes(data)
    digest = FileDigest(path=name, size_bytes=len(data), digest=hashlib.sha256(data).hexdigest(), algorithm="sha256")
    return CheckpointSaved(
        source="n1", node_id="n1", job_id="job-m", rank=0, step=step, path=str(directory), files=[name],
        world_size=1, file_digests=[digest], marker=marker or name,
    )  # fmt: skip


def _rows(client: TestClient, wanted: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 15
    rows: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        rows = client.get("/v1/jobs/job-m/checkpoints").json()["data"]
        if sum(r["state"] == "validated" for r in rows) >= wanted:
            return rows
        time.sleep(0.05)
    raise AssertionError(f"{wanted} validated checkpoints not seen in 15 s: {rows}")


def test_the_events_marker_commits_it_and_one_leaving_its_directory_is_refused(
    nats_client: TestClient, nats_server: NatsServer, tmp_path: Path
) -> None:
    directory = tmp_path / "run"
    directory.mkdir()
    escaping = _snapshot(directory, 5, marker="../../etc/passwd")
    waiting = _snapshot(directory, 6, marker="done-6")  # its marker is not there yet
    good = _snapshot(directory, 7)
    _publish(nats_server.url, [escaping, waiting, good])
    [row] = [r for r in _rows(nats_client, 1) if r["state"] == "validated"]
    assert (row["step"], row["marker"], row["world_size"]) == (7, "snapshot-7.pt", 1)
    steps = {r["step"]: r["state"] for r in nats_client.get("/v1/jobs/job-m/checkpoints").json()["data"]}
    assert steps == {7: "validated", 6: "writing"}  # step 5 refused: never stored
    (directory / "done-6").write_bytes(b"")
    committed = nats_client.post(f"/v1/checkpoints/{_id(nats_client, 6)}/commit")
    assert committed.status_code == 200, committed.text
    assert {r["step"] for r in _rows(nats_client, 2) if r["state"] == "validated"} == {6, 7}


def _id(client: TestClient, step: int) -> int:
    rows = client.get("/v1/jobs/job-m/checkpoints").json()["data"]
    return int(next(r["id"] for r in rows if r["step"] == step))
