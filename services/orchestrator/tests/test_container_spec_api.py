"""A job's `container` section (its ranks in an image): an unsafe spec is a 422 naming the field and nothing is
stored; a safe one is kept in the spec and travels with the launch (real app, NATS, Redis, SQLite)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from reprise_cli.client import poll
from reprise_cli.servers import NatsServer
from reprise_common.events import GpuStatus, LaunchCommand, NodeReport

from .test_checkpoint_spec import _submit_watching_commands


@pytest.fixture
def client(nats_server: NatsServer, admin_client: Any) -> Iterator[TestClient]:
    with admin_client(nats_server.url, command_timeout_s=1.0) as test_client:
        yield test_client


def _body(**container: Any) -> dict[str, Any]:
    return {
        "name": "x",
        "node_count": 1,
        "command": ["python", "train.py"],
        "container": {"image": "team/t:1"} | container,
    }


BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"privileged": True}, "privileged", "privileged containers are refused"),
    ({"pid_mode": "host"}, "pid_mode", "is refused"),
    ({"cap_add": ["SYS_ADMIN"]}, "cap_add", "cap_add refused: SYS_ADMIN"),
    ({"mounts": [{"source": "/var/run/docker.sock", "target": "/var/run/docker.sock"}]}, "mounts.0.source", "Docker"),
    ({"mounts": [{"source": "/", "target": "/host"}]}, "mounts.0.source", "root file system"),
    ({"memory_byte": 2**30}, "memory_byte", "Extra inputs are not permitted"),  # misspelled: never dropped silently
    ({"mounts": [{"source": "/data", "target": "/d", "readonly": False}]}, "mounts.0.readonly", "Extra inputs"),
    ({"memory_bytes": 2**60}, "memory_bytes", "less than or equal"),
]


@pytest.mark.parametrize(("container", "field", "says"), BAD, ids=[f for _, f, _ in BAD])
def test_an_unsafe_container_is_a_422_naming_the_field_and_nothing_is_stored(
    client: TestClient, container: dict[str, Any], field: str, says: str
) -> None:
    response = client.post("/v1/jobs", json=_body(**container))
    assert response.status_code == 422, response.text
    locations = [".".join(str(p) for p in err["loc"]) for err in response.json()["detail"]]
    assert f"body.container.{field}" in locations, response.json()
    assert any(says in err["msg"] for err in response.json()["detail"]), response.json()
    assert client.get("/v1/jobs").json()["count"] == 0


def test_a_safe_container_is_kept_and_travels_with_the_launch(client: TestClient, nats_server: NatsServer) -> None:
    assert poll(lambda: client.get("/readyz").status_code, lambda status: status == 200, timeout_s=15) == 200
    node = NodeReport(source="node-1", node_id="node-1", interval_s=1.0, gpu_backend="sim", gpus=[GpuStatus(index=0)])
    client.app.state.inventory.observe("node-1", node)  # type: ignore[attr-defined]  # as its report would
    body = _body(mounts=[{"source": "/data/run-1", "target": "/data"}], memory_bytes=2**30, cap_add=["IPC_LOCK"])
    launches: list[LaunchCommand] = []
    response = asyncio.run(_submit_watching_commands(client, body, nats_server.url, launches))
    assert response.status_code == 201, response.text
    assert response.json()["spec"]["container"]["image"] == "team/t:1"
    [launch] = launches
    assert launch.args.container is not None
    assert launch.args.container.image == "team/t:1" and launch.args.container.memory_bytes == 2**30
    assert [(m.source, m.target, m.read_only) for m in launch.args.container.mounts] == [("/data/run-1", "/data", True)]
