"""Registration from agents' checkpoint.saved events over a real nats-server, and the validated/corrupt events."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from reprise_cli.servers import NatsServer
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.events import CheckpointChange, CheckpointSaved, Event, FileDigest, JobPlacement, RankAssignment
from reprise_registry.app import create_app
from reprise_registry.validation.hashing import hash_bytes

from .conftest import ADMIN_HEADERS, registry_settings


@pytest.fixture
def nats_client(sqlite_url: str, nats_server: NatsServer) -> Iterator[TestClient]:
    settings = registry_settings(sqlite_url, nats_url=nats_server.url, consume_agent_events=True)
    with TestClient(create_app(settings), headers=ADMIN_HEADERS) as client:
        yield client


def _publish(url: str, events: list[tuple[str, Event]]) -> None:
    async def run() -> None:
        bus = Bus(url=url, service="test-agent")
        await bus.connect(attempts=20)
        for subject, event in events:
            await bus.publish(subject, event)
        await bus.close()

    asyncio.run(run())


def _changes(url: str, job_id: str) -> list[CheckpointChange]:
    async def run() -> list[CheckpointChange]:
        bus = Bus(url=url, service="test-reader", provision=False)
        await bus.connect(attempts=20)
        sub = await bus.js.subscribe(f"reprise.checkpoint.{job_id}.>", stream="CHECKPOINTS", ordered_consumer=True)
        found: list[CheckpointChange] = []
        try:
            while True:
                msg = await sub.next_msg(timeout=0.5)
                found.append(CheckpointChange.model_validate_json(msg.data))
        except TimeoutError:
            pass
        await bus.close()
        return found

    return asyncio.run(run())


def _rank_files(root: Path, rank: int) -> tuple[list[str], list[FileDigest]]:
    data = os.urandom(10_000 + rank)
    path = root / f"rank-{rank:05d}.pt"
    path.write_bytes(data)
    return [str(path)], [FileDigest(path=str(path), size_bytes=len(data), digest=hash_bytes(data))]


def _wait_state(client: TestClient, job_id: str, state: str) -> dict[str, Any]:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        rows = client.get(f"/v1/jobs/{job_id}/checkpoints").json()["data"]
        if rows and rows[0]["state"] == state:
            return dict(rows[0])
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} has no {state} checkpoint after 15 s: {rows}")


def _saved(job_id: str, node: str, rank: int, root: Path, step: int, **extra: Any) -> tuple[str, CheckpointSaved]:
    files, digests = _rank_files(root, rank)
    event = CheckpointSaved(
        source=node, node_id=node, job_id=job_id, rank=rank, step=step, path=str(root), files=files,
        file_digests=digests, **extra,
    )  # fmt: skip
    return subjects.node_event(node, "checkpoint.saved"), event


def test_agent_events_register_commit_and_validate(
    nats_client: TestClient, nats_server: NatsServer, tmp_path: Path
) -> None:
    root = tmp_path / "job-n" / "step-40"
    root.mkdir(parents=True)
    (root / "COMMITTED").write_bytes(b"")
    events = [_saved("job-n", f"node-{rank}", rank, root, 40, world_size=2) for rank in range(2)]
    _publish(nats_server.url, events[:1])
    assert _wait_state(nats_client, "job-n", "writing")["world_size"] == 2  # one rank of two: not committed
    _publish(nats_server.url, events[1:] + events[:1])  # the second rank, and a redelivered copy of the first
    validated = _wait_state(nats_client, "job-n", "validated")
    assert validated["step"] == 40 and validated["file_count"] == 2
    assert nats_client.get("/v1/jobs/job-n/checkpoints/latest").json()["id"] == validated["id"]
    deadline = time.monotonic() + 10
    while not (changes := _changes(nats_server.url, "job-n")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [(c.change, c.checkpoint_id, c.manifest_digest) for c in changes] == [
        ("validated", validated["id"], validated["manifest_digest"])
    ]


def test_world_size_from_the_placement_and_a_corrupt_one_is_announced(
    nats_client: TestClient, nats_server: NatsServer, tmp_path: Path
) -> None:
    root = tmp_path / "job-p" / "step-7"
    root.mkdir(parents=True)
    (root / "COMMITTED").write_bytes(b"")
    events = [_saved("job-p", "node-a", rank, root, 7) for rank in range(3)]  # no world size in the events
    (root / "rank-00002.pt").write_bytes(b"torn")  # rank 2's file no longer matches what it reported
    _publish(nats_server.url, events)
    assert _wait_state(nats_client, "job-p", "writing")["world_size"] is None
    ranks = [RankAssignment(rank=r, node_id="node-a", local_rank=r) for r in range(3)]
    placement = JobPlacement(source="orchestrator", job_id="job-p", restart_epoch=0, world_size=3, ranks=ranks)
    _publish(nats_server.url, [(subjects.placement("job-p"), placement)])
    corrupt = _wait_state(nats_client, "job-p", "corrupt")
    assert corrupt["reason"].startswith("size_mismatch: rank-00002.pt")
    assert nats_client.get("/v1/jobs/job-p/checkpoints/latest").status_code == 404
    deadline = time.monotonic() + 10
    while not (changes := _changes(nats_server.url, "job-p")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [c.change for c in changes] == ["corrupt"] and changes[0].reason == corrupt["reason"]
