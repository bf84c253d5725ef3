"""A job's `checkpoints` section (a script's own checkpoints): bad input is a 422 naming the field and nothing is
stored; a good one is kept in the spec and travels with the launch (real app, NATS, Redis, SQLite)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from reprise_cli.client import poll
from reprise_cli.servers import NatsServer
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.events import GpuStatus, LaunchCommand, NodeReport, parse_command


@pytest.fixture
def roots(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    (root / "run-1").mkdir(parents=True)
    return root


@pytest.fixture
def client(nats_server: NatsServer, admin_client: Any, roots: Path) -> Iterator[TestClient]:
    with admin_client(nats_server.url, command_timeout_s=1.0, checkpoint_roots=[roots]) as test_client:
        yield test_client


def _body(roots: Path, **section: Any) -> dict[str, Any]:
    checkpoints = {"directory": str(roots / "run-1"), "pattern": "snapshot-{step}.pt", "layout": "file"} | section
    return {"name": "x", "node_count": 1, "command": ["true"], "checkpoints": checkpoints}


def _locations(response: Any) -> list[str]:
    return [".".join(str(p) for p in err["loc"]) for err in response.json()["detail"]]


BAD: list[tuple[dict[str, Any], str, str]] = [
    # escapes the allowed roots
    ({"directory": "/etc/reprise"}, "directory", "outside the checkpoint roots"),
    ({"directory": "{roots}/run-1/../../.."}, "directory", "'..'"),
    ({"directory": "run-1"}, "directory", "not an absolute path"),
    ({"directory": "{roots}"}, "directory", "outside the checkpoint roots"),  # a root itself is no checkpoint place
    ({"directory": "{roots}/link-out"}, "directory", "outside the checkpoint roots"),  # a symlink leading out
    # yields no step
    ({"pattern": "snapshot.pt"}, "pattern", "yields no step"),
    ({"pattern": "snap-{step}-{step}.pt"}, "pattern", "2 times"),
    ({"pattern": "snap-{step}*.pt"}, "pattern", "could not be read"),
    ({"pattern": "model-{step}.pt", "layout": "per_rank"}, "pattern", "{rank}"),
    # matches nothing
    ({"pattern": "sub/snapshot-{step}.pt"}, "pattern", "matches nothing"),
    ({"pattern": "ckpt-{step}", "layout": "hf"}, "pattern", "matches none of them"),
    ({"pattern": "s" * 250 + "{step}"}, "pattern", "at most 200"),
    # other bounds, and unknown fields
    ({"pattern": "snap {step}.pt"}, "pattern", "a pattern holds"),
    ({"layout": "zip"}, "layout", "Input should be"),
    ({"poll_s": 0}, "poll_s", "greater than or equal"),
    ({"restore_args": ["--resume={restore_dir}"]}, "restore_args", "only placeholders"),
    ({"restore_args": ["x"] * 17}, "restore_args", "at most 16"),
    ({"restore_env": "NOT A NAME"}, "restore_env", "pattern"),
    ({"patern": "x-{step}"}, "patern", "Extra inputs"),
]


@pytest.mark.parametrize(("section", "field", "says"), BAD, ids=[f"{f}:{s}" for _, f, s in BAD])
def test_a_bad_section_is_a_422_naming_the_field_and_nothing_is_stored(
    client: TestClient, roots: Path, section: dict[str, Any], field: str, says: str
) -> None:
    (roots / "link-out").symlink_to("/etc")
    section = {k: v.replace("{roots}", str(roots)) if isinstance(v, str) else v for k, v in section.items()}
    response = client.post("/v1/jobs", json=_body(roots, **section))
    assert response.status_code == 422, response.text
    assert f"body.checkpoints.{field}" in _locations(response), response.json()
    assert any(says in err["msg"] for err in response.json()["detail"]), response.json()
    assert client.get("/v1/jobs").json()["count"] == 0


def test_a_good_section_is_kept_and_travels_with_the_launch(
    client: TestClient, roots: Path, nats_server: NatsServer
) -> None:
    assert poll(lambda: client.get("/readyz").status_code, lambda status: status == 200, timeout_s=15) == 200
    node = NodeReport(source="node-1", node_id="node-1", interval_s=1.0, gpu_backend="sim", gpus=[GpuStatus(index=0)])
    client.app.state.inventory.observe("node-1", node)  # type: ignore[attr-defined]  # as its report would
    section = {"layout": "hf", "directory": str(roots / "run-1"), "restore_args": ["--resume", "{restore_path}"]}
    body = {"name": "x", "node_count": 1, "command": ["true"], "checkpoints": section}
    launches: list[LaunchCommand] = []
    response = asyncio.run(_submit_watching_commands(client, body, nats_server.url, launches))
    assert response.status_code == 201, response.text
    kept = response.json()["spec"]["checkpoints"]
    assert kept["pattern"] == "checkpoint-{step}" and kept["layout"] == "hf"  # Trainer's names by default
    [launch] = launches
    assert launch.args.checkpoints is not None
    assert launch.args.checkpoints.pattern == "checkpoint-{step}"
    assert launch.args.checkpoints.restore_args == ["--resume", "{restore_path}"]


async def _submit_watching_commands(
    client: TestClient, body: dict[str, Any], nats_url: str, launches: list[LaunchCommand]
) -> Any:
    """Submit the job while a subscriber records the launch command sent to node-1 (it answers nothing)."""
    bus = Bus(url=nats_url, service="test-checkpoint-spec", provision=False)
    await bus.connect()

    async def record(msg: Any) -> None:
        command = parse_command(msg.data)
        if isinstance(command, LaunchCommand):
            launches.append(command)

    sub = await bus.nc.subscribe(subjects.node_command("node-1"), cb=record)
    try:
        await bus.nc.flush()
        response = await asyncio.to_thread(client.post, "/v1/jobs", json=body)
        await bus.nc.flush()
        await asyncio.sleep(0.1)
        return response
    finally:
        await sub.unsubscribe()
        await bus.close()
