"""The compose topology as a user starts it (docs/compose.md): every service of docker-compose.yml ready, and one
injected fault (an XID 79 on a node) travelling agent → detector → orchestrator → agents inside the containers, the
job recovered on the spare and read back through the orchestrator's REST API."""

from __future__ import annotations

import json
from contextlib import closing
from typing import Any

import httpx
import pytest
import yaml

from reprise_cli.client import PlatformClient, poll
from reprise_cli.creds import ADMIN, seed_file
from reprise_common.events import FaultKind, InjectFault

from .conftest import COMPOSE_FILE, Compose, compose_unavailable_reason

pytestmark = [
    pytest.mark.stack,
    pytest.mark.timeout(1200),  # cold: the platform image (debootstrap) and every image built first
    pytest.mark.skipif(compose_unavailable_reason() is not None, reason=str(compose_unavailable_reason())),
]

# A rank with nothing but the standard library (the agent's image has no SDK): it works until it is stopped, so the
# recovery verifies it by settling, alive and busy (about a fifth of a CPU: verifying wants 2 % even on a loaded
# machine, and a rank that mostly sleeps falls under it), not by steps.
RANK = "import time\nwhile True:\n    sum(range(300_000))\n    time.sleep(0.01)\n"


def _summary(recoveries: list[dict[str, Any]]) -> str:
    """Each recovery's outcome and steps, one line a step: what a failed assertion shows."""
    lines = []
    for recovery in recoveries:
        lines.append(f"{recovery['id']}: attempt {recovery.get('attempt')} outcome {recovery.get('outcome')}")
        lines += [f"  {s['step']}: {s.get('detail')} {json.dumps(s.get('data'))[:300]}" for s in recovery["steps"]]
    return "\n".join(lines) or "no recovery"


def _client(compose: Compose) -> PlatformClient:
    return PlatformClient(
        orchestrator=compose.url("orchestrator", 8730),
        detector=compose.url("detector", 8720),
        registry=compose.url("checkpoint-registry", 8710),
        nats_url=compose.nats_url(),
        nkey_seed_file=seed_file(compose.creds, ADMIN),
        api_key=compose.admin_api_key,
    )


def test_every_service_is_up_and_ready(compose: Compose) -> None:
    services: dict[str, dict[str, Any]] = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
    health = compose.health()
    assert set(health) == set(services), f"services without a container: {sorted(set(services) - set(health))}"
    assert set(health.values()) == {"healthy"}, f"{health}\n{compose.logs()}"
    ports = {
        name: int(s["environment"]["REPRISE_HTTP_PORT"])
        for name, s in services.items()
        if "environment" in s and "REPRISE_HTTP_PORT" in s["environment"]
    }
    assert len(ports) == len(services) - 3, ports  # every service but NATS, Redis and PostgreSQL
    for service, port in ports.items():
        answer = httpx.get(compose.url(service, port) + "/readyz", timeout=5)
        assert answer.status_code == 200, f"{service}: /readyz {answer.status_code} {answer.text}"


def test_an_injected_xid79_is_recovered_on_the_spare(compose: Compose) -> None:
    with closing(_client(compose)) as client:
        nodes = poll(client.nodes, lambda n: len(n) == 3, timeout_s=30, interval_s=0.5)
        assert {n["node_id"] for n in nodes} == {"node-1", "node-2", "spare-1"}
        job = client.submit(
            {
                "name": "compose",
                "node_count": 2,
                "ranks_per_node": 1,
                "command": ["/opt/reprise/bin/python", "-c", RANK],
                "policy": {"verify_by": "settle", "verify_settle_s": 2},
            }
        )
        assert job["state"] == "running", job
        assert {r["node_id"] for r in job["placement"]} == {"node-1", "node-2"}

        reply = client.inject(InjectFault(kind=FaultKind.XID, gpu=0, xid=79), node_id="node-2")
        assert reply.accepted, reply

        recoveries = poll(
            lambda: client.recoveries(job["id"]),
            lambda r: bool(r) and r[0].get("outcome") is not None,
            timeout_s=90,
            interval_s=0.5,
        )
        if not recoveries or recoveries[0]["outcome"] != "recovered":
            print(compose.logs(tail=200))  # shown with the failure: what each container said
        assert recoveries and recoveries[0]["outcome"] == "recovered", _summary(recoveries)
        steps = {s["step"]: s for s in recoveries[0]["steps"]}
        assert steps["isolating"]["data"]["cordoned"] == "node-2"
        assert steps["placing"]["data"]["replaced"] == {"node-2": "spare-1"}
        relaunched = client.job(job["id"])
        assert relaunched["restart_epoch"] == 1
        assert sorted(r["node_id"] for r in relaunched["placement"]) == ["node-1", "spare-1"]
        client.cancel(job["id"])
