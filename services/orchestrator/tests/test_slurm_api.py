"""The slurm backend seen through the orchestrator's REST API, against the real Slurm cluster on this host (the
session's, conftest.py): a controller that does not answer is a 503 naming it, each job shows its backend, and a
recovery's drain names its incident in `sinfo -R`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlmodel import Session

from reprise_cli.servers import NatsServer
from reprise_cli.slurm import SlurmCluster
from reprise_common.events import GpuStatus, NodeReport
from reprise_orchestrator.deps import Deps
from reprise_orchestrator.jobs import service as jobs
from reprise_orchestrator.jobs.models import JobCreate
from reprise_orchestrator.nodes import flows as node_flows
from reprise_orchestrator.recoveries import service as recoveries
from reprise_orchestrator.recoveries.models import Recovery

from .test_slurm_cli import sinfo_reasons

TIMEOUT_S = 4.0


@pytest.fixture
def slurm_client(slurm_cluster: SlurmCluster, nats_server: NatsServer, admin_client: Any) -> Iterator[TestClient]:
    """The orchestrator app with REPRISE_COMPUTE_BACKEND=slurm on the session's cluster."""
    with admin_client(
        nats_server.url,
        compute_backend="slurm",
        slurm_conf=slurm_cluster.conf_path,
        slurm_command_timeout_s=TIMEOUT_S,
        slurm_poll_interval_s=0.3,
        command_timeout_s=1.0,
    ) as client:
        yield client


def deps_of(client: TestClient) -> Deps:
    """The app's collaborators."""
    deps: Deps = client.app.state.deps  # type: ignore[attr-defined]
    return deps


def test_a_controller_that_does_not_answer_is_a_503_naming_it(
    slurm_client: TestClient, slurm_cluster: SlurmCluster
) -> None:
    slurm_cluster.stop_controller()

    response = slurm_client.post("/v1/nodes/node2/cordon", json={"reason": "bad DIMM"})

    assert response.status_code == 503, response.text
    assert response.json()["detail"].startswith("the Slurm controller is unavailable: ")
    slurm_cluster.start_controller()
    assert slurm_client.post("/v1/nodes/node2/cordon", json={"reason": "bad DIMM"}).status_code == 200
    assert sinfo_reasons(slurm_cluster)["node2"] == "reprise: bad DIMM"


def test_each_job_shows_the_backend_that_runs_it(nats_server: NatsServer, admin_client: Any) -> None:
    with admin_client(nats_server.url, command_timeout_s=1.0) as client:  # no agent answers: the launch fails fast
        node = NodeReport(source="n1", node_id="n1", interval_s=1.0, gpu_backend="sim", gpus=[GpuStatus(index=0)])
        deps_of(client).inventory.observe("n1", node)  # as its report would
        created = client.post("/v1/jobs", json={"name": "a", "node_count": 1, "command": ["true"]})
        assert created.status_code == 201, created.text
        assert created.json()["backend"] == "agents"
        with Session(deps_of(client).engine) as session:  # as a job the slurm backend ran (or a replica of it)
            spec = JobCreate(name="b", node_count=1, command=["true"])
            other = jobs.create(session, spec=spec, placement=[], backend="slurm").id
        shown = {job["id"]: job["backend"] for job in client.get("/v1/jobs").json()["data"]}
        assert shown == {created.json()["id"]: "agents", other: "slurm"}
        assert client.get(f"/v1/jobs/{other}").json()["backend"] == "slurm"


def test_a_recoverys_drain_names_its_incident_in_sinfo(slurm_client: TestClient, slurm_cluster: SlurmCluster) -> None:
    deps = deps_of(slurm_client)
    with Session(deps.engine) as session:
        job = jobs.create(session, spec=JobCreate(name="j", node_count=1, command=["true"]), placement=[])
        session.add(Recovery(id="rec-1", job_id=job.id, incident_id="inc-7f3a", fence=1, owner="replica-a"))
        session.commit()
        started_by = recoveries.incident_of(session, recovery_id="rec-1")  # as the recovery's isolate step reads it

    for node, by, incident_id in (("node3", "recovery:rec-1", started_by), ("node4", "api", None)):
        reason = "GPU XID 79 (fallen off the bus)"
        asyncio.run(node_flows.cordon(deps, node_id=node, reason=reason, by=by, incident_id=incident_id))

    reasons = sinfo_reasons(slurm_cluster)
    assert reasons["node3"] == "reprise: incident inc-7f3a: GPU XID 79 (fallen off the bus)"
    assert reasons["node4"] == "reprise: GPU XID 79 (fallen off the bus)"  # an operator's cordon names no incident
    assert slurm_client.get("/v1/nodes").status_code == 200
