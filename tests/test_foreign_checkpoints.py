"""Checkpoints a script saved itself, end to end across services: the agent's watcher reports a real torch.save
file, a DCP directory and a Hugging Face-style checkpoint-N directory over a real nats-server; the registry (real
SQLite) records, hashes and validates each like an SDK-reported one; a torn one is never reported, one flipped
before validation is marked corrupt, and one flipped after validation is refused by the agent before launch, after
which the registry falls back to the older checkpoint, which reaches the script through its arguments."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from fastapi.testclient import TestClient

from reprise_agent import foreign_restore
from reprise_agent.foreign_checkpoints import CheckpointWatcher, Scope
from reprise_cli.client import poll
from reprise_cli.servers import NatsServer
from reprise_cli.stack import Stack
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.events import (
    CheckpointSaved,
    CheckpointWatch,
    FaultKind,
    InjectFault,
    LaunchArgs,
    RankAssignment,
    ResumeFile,
)
from reprise_registry.app import create_app
from reprise_registry.settings import RegistrySettings

KEY = secrets.token_urlsafe(32)
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
RANK_0 = Scope(frozenset({0}), world_size=2, restart_epoch=0)


@pytest.fixture
def roots(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    root.mkdir()
    return root


@pytest.fixture
def registry(tmp_path: Path, nats_server: NatsServer, roots: Path) -> Iterator[TestClient]:
    settings = RegistrySettings(
        database_url=f"sqlite:///{tmp_path / 'registry.db'}",
        nats_url=nats_server.url,
        consume_agent_events=True,
        validate_interval_s=0.2,
        retention_interval_s=3600.0,
        checkpoint_roots=[roots],
        log_format="text",
        admin_api_key=KEY,
    )
    with TestClient(create_app(settings), headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


def _watch(directory: Path, layout: str, pattern: str, **more: Any) -> CheckpointWatch:
    directory.mkdir(parents=True, exist_ok=True)
    return CheckpointWatch(directory=str(directory), layout=layout, pattern=pattern, **more)


def _until_reported(watcher: CheckpointWatcher, polls: int = 3) -> list[CheckpointSaved]:
    events: list[CheckpointSaved] = []
    for _ in range(polls):
        events += watcher.poll()
    return events


def _publish(url: str, events: list[CheckpointSaved]) -> None:
    """As the agent's outbox does: on the node's checkpoint.saved subject, into the AGENT stream."""

    async def run() -> None:
        bus = Bus(url=url, service="agent-n1")
        await bus.connect(attempts=20)
        for event in events:
            await bus.publish(subjects.node_event("n1", "checkpoint.saved"), event)
        await bus.close()

    asyncio.run(run())


def _states(client: TestClient, job_id: str, count: int) -> dict[int, dict[str, Any]]:
    """The job's checkpoints by step, once `count` of them are decided (validated or corrupt)."""
    deadline = time.monotonic() + 20
    rows: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        rows = client.get(f"/v1/jobs/{job_id}/checkpoints").json()["data"]
        if sum(r["state"] in ("validated", "corrupt") for r in rows) >= count:
            return {r["step"]: r for r in rows}
        time.sleep(0.05)
    raise AssertionError(f"{job_id}: {count} checkpoints not decided in 20 s: {rows}")


def _flip(path: Path) -> None:
    """One bit, in place, size and mtime kept: what silent corruption looks like."""
    before = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_a_dcp_and_an_hf_checkpoint_are_validated_and_a_torn_one_never_reported(
    registry: TestClient, nats_server: NatsServer, roots: Path
) -> None:
    dcp_watch = CheckpointWatcher("job-dcp", "n1", _watch(roots / "dcp", "dcp", "step-{step}"), RANK_0)
    hf_watch = CheckpointWatcher("job-hf", "n1", _watch(roots / "hf", "hf", "checkpoint-{step}"), RANK_0)
    dcp_watch.poll(), hf_watch.poll()
    dcp.save({"model": {"w": torch.arange(256.0)}}, checkpoint_id=str(roots / "dcp" / "step-100"))
    dcp.save({"model": {"w": torch.zeros(8)}}, checkpoint_id=str(roots / "dcp" / "step-200"))
    (roots / "dcp" / "step-200" / ".metadata").unlink()  # torn: the coordinator never wrote it
    hf = roots / "hf" / "checkpoint-100"
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(os.urandom(10_000))
    torch.save({"step": 100}, hf / "optimizer.pt")
    (hf / "trainer_state.json").write_text(json.dumps({"global_step": 100}))
    reported = _until_reported(dcp_watch) + _until_reported(hf_watch)
    assert sorted((e.job_id, e.step) for e in reported) == [("job-dcp", 100), ("job-hf", 100)]
    _publish(nats_server.url, reported)
    for job_id in ("job-dcp", "job-hf"):
        [row] = _states(registry, job_id, 1).values()
        assert (row["state"], row["world_size"]) == ("validated", 1), row
    assert _states(registry, "job-dcp", 1)[100]["layout"] == "dcp"  # its .metadata was loaded and checked too
    assert _states(registry, "job-hf", 1)[100]["marker"] == "trainer_state.json"


def test_a_flipped_checkpoint_is_never_restored_and_the_older_one_reaches_the_script(
    registry: TestClient, nats_server: NatsServer, roots: Path
) -> None:
    watch = _watch(roots / "run", "file", "snapshot-{step}.pt", restore_args=["--resume", "{restore_path}"])
    watcher = CheckpointWatcher("job-1", "n1", watch, RANK_0)
    watcher.poll()
    for step in (10, 20, 30):
        torch.save({"w": torch.full((1000,), float(step))}, roots / "run" / f"snapshot-{step}.pt")
    reported = _until_reported(watcher)
    assert [e.step for e in reported] == [10, 20, 30]
    _flip(roots / "run" / "snapshot-30.pt")  # after the agent hashed it, before the registry validated it
    _publish(nats_server.url, reported)
    states = _states(registry, "job-1", 3)
    assert (states[10]["state"], states[20]["state"]) == ("validated", "validated")
    assert states[30]["state"] == "corrupt" and states[30]["reason"].startswith("digest_mismatch"), states[30]

    _flip(roots / "run" / "snapshot-20.pt")  # after validation: the registry's size re-check cannot see it
    pick = registry.post("/v1/jobs/job-1/restore-point").json()
    assert pick["checkpoint"]["step"] == 20
    with pytest.raises(foreign_restore.RestoreRefusedError) as refused:  # the agent starts no rank on it
        foreign_restore.prepared(_launch_args(watch, pick))
    assert refused.value.problem.startswith("digest: snapshot-20.pt")

    failed = registry.post(f"/v1/checkpoints/{pick['checkpoint']['id']}/load-failed", json={"reason": "refused"})
    assert failed.status_code == 200, failed.text
    pick = registry.post("/v1/jobs/job-1/restore-point").json()
    assert pick["checkpoint"]["step"] == 10
    launch = foreign_restore.prepared(_launch_args(watch, pick))
    assert launch.command == ["python", "train.py", "--resume", str(roots / "run" / "snapshot-10.pt")]
    assert _state_becomes(registry, "job-1", 20, "corrupt")  # the load failure's re-hash found the flip


def _state_becomes(client: TestClient, job_id: str, step: int, state: str) -> bool:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if _states(client, job_id, 1)[step]["state"] == state:
            return True
        time.sleep(0.05)
    return False


def _launch_args(watch: CheckpointWatch, pick: dict[str, Any]) -> LaunchArgs:
    files = [ResumeFile.model_validate(f) for f in pick["files"]]
    return LaunchArgs(
        restart_epoch=1,
        world_size=1,
        master_addr="127.0.0.1",
        master_port=29500,
        command=["python", "train.py"],
        resume_checkpoint=pick["checkpoint"]["path"],
        resume_files=files,
        ranks=[RankAssignment(rank=0, node_id="n1", local_rank=0)],
        checkpoints=watch,
    )


# --- the whole platform: a plain script's own checkpoint restored after a fault ----------------------------------
PLAIN = """
import json, os, sys, time
directory, starts = sys.argv[1], sys.argv[2]
resume = sys.argv[sys.argv.index("--resume") + 1] if "--resume" in sys.argv else None
start = {"rank": int(os.environ["RANK"]), "epoch": int(os.environ["REPRISE_RESTART_EPOCH"]), "resume": resume,
         "env": os.environ.get("RESUME_FROM")}
with open(starts, "a") as log:
    log.write(json.dumps(start) + "\\n")
if start["rank"] == 0 and start["epoch"] == 0:
    for step in (30, 40):
        path = os.path.join(directory, f"snapshot-{step}.pt")
        with open(path + ".tmp", "wb") as f:
            f.write(os.urandom(20_000 + step))
        os.replace(path + ".tmp", path)
time.sleep(600)
"""


def _starts(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.stack
def test_a_plain_scripts_flipped_checkpoint_is_refused_and_the_older_one_restored(stack: Stack, tmp_path: Path) -> None:
    directory, starts = tmp_path / "ckpt" / "run", tmp_path / "starts.jsonl"
    directory.mkdir(parents=True)
    section = {"directory": str(directory), "layout": "file", "pattern": "snapshot-{step}.pt", "poll_s": 0.5,
               "restore_args": ["--resume", "{restore_path}"], "restore_env": "RESUME_FROM"}  # fmt: skip
    client = stack.client()
    try:
        poll(client.nodes, lambda n: len(n) == 3, timeout_s=15)
        job = client.submit({
            "name": "plain", "node_count": 2, "ranks_per_node": 1, "checkpoints": section,
            "command": [sys.executable, "-c", PLAIN, str(directory), str(starts)],
        })  # fmt: skip
        assert job["state"] == "running", job
        latest = poll(lambda: client.latest_checkpoint(job["id"]).json(), lambda b: b.get("step") == 40, timeout_s=30)
        assert latest["step"] == 40 and latest["path"] == str(directory)
        _flip(directory / "snapshot-40.pt")  # silently, after validation
        reply = client.inject(InjectFault(kind=FaultKind.RANK_KILL, rank=1, job_id=job["id"]), node_id="node-2")
        assert reply.accepted, reply.detail
        older = str(directory / "snapshot-30.pt")
        restored = poll(
            lambda: [s for s in _starts(starts) if s["resume"] is not None], lambda s: len(s) >= 2, timeout_s=60
        )
        steps = [(r["attempt"], r["step"], r.get("detail", "")) for r in client.recoveries(job["id"])[0]["steps"]]
        assert {(s["rank"], s["resume"], s["env"]) for s in restored} == {(0, older, older), (1, older, older)}, steps
        assert not any(s["resume"] == str(directory / "snapshot-40.pt") for s in _starts(starts))  # never started
        url = f"{stack.url('checkpoint-registry')}/v1/jobs/{job['id']}/checkpoints"
        states = poll(lambda: {c["step"]: c["state"] for c in client.http.get(url).json()["data"]},
                      lambda s: s.get(40) == "corrupt", timeout_s=15)  # fmt: skip
        assert states == {30: "validated", 40: "corrupt"}  # the load failure's re-hash found the flip
    finally:
        client.close()
