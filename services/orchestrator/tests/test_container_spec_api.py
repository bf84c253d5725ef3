"""A job's `container` section (its ranks in an image): an unsafe spec is a 422 naming the field and nothing is
stored; so is one that no usable node's agent runs, by what the nodes' reports say they allow (image allow-list, mount
roots, a Docker daemon at all); a safe one goes to a node that runs it, is kept in the spec and travels with the launch
(real app, NATS, Redis, SQLite)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from reprise_cli.client import poll
from reprise_cli.servers import NatsServer
from reprise_common.events import ContainerSupport, GpuStatus, LaunchCommand, NodeReport

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


def report(client: TestClient, node_id: str, containers: ContainerSupport | None) -> None:
    """The node's report, as its agent would send it, with what it lets containers use."""
    node = NodeReport(
        source=node_id, node_id=node_id, interval_s=1.0, gpu_backend="sim", gpus=[GpuStatus(index=0)],
        containers=containers,
    )  # fmt: skip
    client.app.state.inventory.observe(node_id, node)  # type: ignore[attr-defined]


DATA_AND_TEAM = ContainerSupport(mount_roots=["/data"], images=["team/t:1"])
NOT_RUNNABLE: list[tuple[ContainerSupport | None, dict[str, Any], str, str]] = [
    (DATA_AND_TEAM, {"image": "other/o:2"}, "container.image", "not on the node's image allow-list"),
    (DATA_AND_TEAM, {"mounts": [{"source": "/etc", "target": "/e"}]}, "container.mounts.0.source", "mount roots"),
    (DATA_AND_TEAM, {"mounts": [{"source": "/data/../etc", "target": "/e"}]}, "container.mounts.0.source", "/etc"),
    (None, {}, "container", "runs no containers"),
]


@pytest.mark.parametrize(
    ("support", "container", "field", "says"), NOT_RUNNABLE, ids=["image", "mount", "mount-dotdot", "no-docker"]
)
def test_a_container_no_usable_node_runs_is_a_422_naming_the_field_and_nothing_is_stored(
    client: TestClient, support: ContainerSupport | None, container: dict[str, Any], field: str, says: str
) -> None:
    report(client, "node-1", support)
    response = client.post("/v1/jobs", json=_body(**container))
    assert response.status_code == 422, response.text
    [error] = response.json()["detail"]
    assert ".".join(str(p) for p in error["loc"]) == f"body.{field}" and says in error["msg"], error
    assert "node-1" in error["msg"]
    assert client.get("/v1/jobs").json()["count"] == 0


def test_a_job_naming_a_node_that_refuses_its_container_is_a_422(client: TestClient) -> None:
    report(client, "node-1", DATA_AND_TEAM)
    report(client, "node-2", ContainerSupport(mount_roots=["/data"], images=["other/o:2"]))
    response = client.post("/v1/jobs", json={**_body(), "node_count": None, "nodes": ["node-2"]})
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"] == ["body", "container", "image"]
    assert client.get("/v1/jobs").json()["count"] == 0


def test_a_safe_container_is_kept_and_travels_with_the_launch(client: TestClient, nats_server: NatsServer) -> None:
    assert poll(lambda: client.get("/readyz").status_code, lambda status: status == 200, timeout_s=15) == 200
    report(client, "node-0", ContainerSupport(mount_roots=["/scratch"]))  # first in order, but not its mounts
    report(client, "node-1", DATA_AND_TEAM)
    body = _body(mounts=[{"source": "/data/run-1", "target": "/data"}], memory_bytes=2**30, cap_add=["IPC_LOCK"])
    launches: list[LaunchCommand] = []
    response = asyncio.run(_submit_watching_commands(client, body, nats_server.url, launches))
    assert response.status_code == 201, response.text
    assert response.json()["spec"]["container"]["image"] == "team/t:1"
    [launch] = launches
    assert launch.args.container is not None
    assert launch.args.container.image == "team/t:1" and launch.args.container.memory_bytes == 2**30
    assert [(m.source, m.target, m.read_only) for m in launch.args.container.mounts] == [("/data/run-1", "/data", True)]
