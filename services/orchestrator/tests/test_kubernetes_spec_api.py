"""A job's `kubernetes` section (where its pods run): a namespace, node selector or service account outside what the
operator allowed (REPRISE_KUBERNETES_*), a misspelled field or a value Kubernetes would refuse is a 422 naming the
field and nothing is stored; an allowed section is kept in the job's spec (real app, NATS, Redis, SQLite)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from reprise_cli.client import poll
from reprise_cli.servers import NatsServer
from reprise_common.events import GpuStatus, LaunchCommand, NodeReport
from reprise_orchestrator.settings import OrchestratorSettings

from .test_checkpoint_spec import _submit_watching_commands

ALLOWED: dict[str, Any] = {
    "kubernetes_namespaces": ["team-a", "team-b"],
    "kubernetes_node_selectors": {"reprise.dev/pool": ["h100", "h200"], "topology.kubernetes.io/zone": ["*"]},
    "kubernetes_service_accounts": ["trainer"],
}


@pytest.fixture
def client(nats_server: NatsServer, admin_client: Any) -> Iterator[TestClient]:
    with admin_client(nats_server.url, command_timeout_s=1.0, **ALLOWED) as test_client:
        yield test_client


def _body(**kubernetes: Any) -> dict[str, Any]:
    return {"name": "x", "node_count": 1, "command": ["python", "train.py"], "kubernetes": kubernetes}


NOT_ALLOWED: list[tuple[dict[str, Any], str, str]] = [
    ({"namespace": "kube-system"}, "namespace", "namespace 'kube-system' is not allowed (allowed: team-a, team-b)"),
    ({"node_selector": {"reprise.dev/pool": "a100"}}, "node_selector.reprise.dev/pool", "reprise.dev/pool='a100'"),
    ({"node_selector": {"kubernetes.io/hostname": "n1"}}, "node_selector.kubernetes.io/hostname", "key"),
    ({"service_account": "cluster-admin"}, "service_account", "service account 'cluster-admin' is not allowed"),
]
MALFORMED: list[tuple[dict[str, Any], str, str]] = [
    ({"namespace": "Team_A"}, "namespace", "not a namespace name"),
    ({"namespace": "a" * 64}, "namespace", "not a namespace name"),
    ({"service_account": "trainer;rm"}, "service_account", "not a service account name"),
    ({"node_selector": {"reprise.dev/pool": "h100 --all"}}, "node_selector.reprise.dev/pool", "label value"),
    ({"namespaces": "team-a"}, "namespaces", "Extra inputs are not permitted"),  # misspelled: never dropped silently
]


@pytest.mark.parametrize(
    ("kubernetes", "field", "says"), NOT_ALLOWED + MALFORMED, ids=[f for _, f, _ in NOT_ALLOWED + MALFORMED]
)
def test_a_section_outside_the_operators_allowance_is_a_422_naming_the_field_and_nothing_is_stored(
    client: TestClient, kubernetes: dict[str, Any], field: str, says: str
) -> None:
    response = client.post("/v1/jobs", json=_body(**kubernetes))
    assert response.status_code == 422, response.text
    locations = [".".join(str(p) for p in err["loc"]) for err in response.json()["detail"]]
    assert f"body.kubernetes.{field}" in locations, response.json()
    assert any(says in err["msg"] for err in response.json()["detail"]), response.json()
    assert client.get("/v1/jobs").json()["count"] == 0


def test_the_default_allowance_refuses_any_node_selector(nats_server: NatsServer, admin_client: Any) -> None:
    with admin_client(nats_server.url, command_timeout_s=1.0) as client:
        response = client.post("/v1/jobs", json=_body(node_selector={"reprise.dev/pool": "h100"}))
        assert response.status_code == 422, response.text
        [error] = response.json()["detail"]
        assert error["loc"] == ["body", "kubernetes", "node_selector", "reprise.dev/pool"]
        assert "the operator allows none" in error["msg"]
        assert client.get("/v1/jobs").json()["count"] == 0


def test_an_allowed_section_is_kept_in_the_spec(client: TestClient, nats_server: NatsServer) -> None:
    assert poll(lambda: client.get("/readyz").status_code, lambda status: status == 200, timeout_s=15) == 200
    node = NodeReport(source="node-1", node_id="node-1", interval_s=1.0, gpu_backend="sim", gpus=[GpuStatus(index=0)])
    client.app.state.inventory.observe("node-1", node)  # type: ignore[attr-defined]  # as its report would
    section = {
        "namespace": "team-b",
        "node_selector": {"reprise.dev/pool": "h200", "topology.kubernetes.io/zone": "eu-west-1a"},
        "service_account": "trainer",
        "spares": 2,
    }
    launches: list[LaunchCommand] = []
    response = asyncio.run(_submit_watching_commands(client, _body(**section), nats_server.url, launches))
    assert response.status_code == 201, response.text
    assert response.json()["spec"]["kubernetes"] == section
    assert client.get(f"/v1/jobs/{response.json()['id']}").json()["spec"]["kubernetes"] == section


@pytest.mark.parametrize(
    "setting",
    [
        {"kubernetes_namespaces": ["Team_A"]},
        {"kubernetes_service_accounts": ["a b"]},
        {"kubernetes_node_selectors": {"reprise.dev/pool": ["h100 --all"]}},
        {"kubernetes_node_selectors": {"-bad-key": ["*"]}},
    ],
)
def test_an_allow_list_kubernetes_would_not_understand_is_refused_at_start(setting: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="kubernetes_"):
        OrchestratorSettings(database_url="sqlite:///:memory:", **setting)
