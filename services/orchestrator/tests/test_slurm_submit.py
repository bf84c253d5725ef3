"""Jobs on the slurm backend, through the orchestrator's REST API, against the real Slurm cluster on this host (the
session's, conftest.py): a job gets an allocation of its nodes plus its spares, whose batch script starts one real
Reprise agent per node with srun; the job's ranks run on the allocation's workers. The spec's `slurm` section is
validated as the rest of the spec is."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from reprise_cli.client import poll
from reprise_cli.servers import NatsServer
from reprise_cli.slurm import SlurmCluster
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.events import IncidentChange
from reprise_orchestrator.compute.slurm.cli import SlurmCli
from reprise_orchestrator.compute.slurm.models import SlurmJob, SlurmJobState
from reprise_orchestrator.compute.slurm.signals import allocation_name

from . import incidents
from .test_slurm_api import deps_of
from .test_slurm_cli import as_admin, sinfo_reasons

AGENT = str(Path(sys.executable).parent / "reprise-agent")
SLEEPS = ["sh", "-c", "exec sleep 300"]


@pytest.fixture
def slurm_client(
    slurm_cluster: SlurmCluster, nats_server: NatsServer, admin_client: Any, tmp_path: Path
) -> Iterator[TestClient]:
    """The orchestrator with REPRISE_COMPUTE_BACKEND=slurm on the session's cluster, its allocations starting this
    checkout's agent (simulated GPUs) on the test's NATS."""
    agents_env = {"REPRISE_GPU_COUNT": "1", "REPRISE_ADVERTISE_ADDR": "127.0.0.1", "REPRISE_REPORT_INTERVAL_S": "0.5"}
    with admin_client(
        nats_server.url,
        compute_backend="slurm",
        slurm_conf=slurm_cluster.conf_path,
        slurm_command_timeout_s=5.0,
        slurm_poll_interval_s=0.5,
        slurm_agent_command=AGENT,
        slurm_agent_http_port=0,  # any free port: the cluster's nodes, and their agents, share this host
        slurm_agent_env={**agents_env, "REPRISE_STATE_DIR": str(tmp_path / "agents")},
        command_timeout_s=10.0,
        stop_grace_s=1.0,
    ) as client:
        # The app connects to NATS in the background: a job submitted before it did is refused (503, a CI run's).
        assert poll(lambda: client.get("/readyz").status_code, lambda status: status == 200, timeout_s=30) == 200
        yield client


def slurm_settings(cluster: SlurmCluster, tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    """The orchestrator's settings for the session's cluster, its agents this checkout's (any free HTTP port)."""
    return {
        "compute_backend": "slurm",
        "slurm_conf": cluster.conf_path,
        "slurm_poll_interval_s": 0.5,
        "slurm_agent_command": AGENT,
        "slurm_agent_http_port": 0,
        "slurm_agent_env": {"REPRISE_GPU_COUNT": "1", "REPRISE_STATE_DIR": str(tmp_path / "agents")},
        **overrides,
    }


def allocation_of(cluster: SlurmCluster, job_id: str) -> SlurmJob | None:
    """The platform job's newest allocation, as squeue shows it."""
    jobs = asyncio.run(SlurmCli(conf=cluster.conf_path).jobs())
    return max((job for job in jobs if job.name == allocation_name(job_id)), key=lambda j: j.job_id, default=None)


def submit(client: TestClient, tmp_path: Path, *, nodes: int, spares: int) -> dict[str, Any]:
    """Submit a job of sleeping ranks with its allocation's output under the test's directory; the created job."""
    slurm = {"spares": spares, "time_limit_min": 10, "output": str(tmp_path / "slurm-%j.out")}
    created = client.post("/v1/jobs", json={"name": "on-slurm", "node_count": nodes, "command": SLEEPS, "slurm": slurm})
    assert created.status_code == 201, created.text
    job: dict[str, Any] = created.json()
    return job


def running_job(client: TestClient, job_id: str) -> dict[str, Any]:
    """The job once it runs (asserted): its allocation ran, its agents reported, its ranks were launched."""
    job: dict[str, Any] = poll(
        lambda: client.get(f"/v1/jobs/{job_id}").json(), lambda j: j["state"] != "pending", timeout_s=60, interval_s=0.3
    )
    assert job["state"] == "running", job
    return job


def test_a_job_runs_in_an_allocation_of_its_nodes_and_spares_with_an_agent_on_each(
    slurm_client: TestClient, slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    created = submit(slurm_client, tmp_path, nodes=2, spares=1)
    assert (created["state"], created["backend"], created["placement"]) == ("pending", "slurm", [])

    job = running_job(slurm_client, created["id"])

    allocation = allocation_of(slurm_cluster, created["id"])
    assert allocation is not None and allocation.state is SlurmJobState.RUNNING, allocation
    assert len(allocation.nodes) == 3  # the job's 2 nodes and its spare, in one allocation
    workers, spares = list(allocation.nodes[:2]), list(allocation.nodes[2:])
    assert [rank["node_id"] for rank in job["placement"]] == workers
    ranks = poll(
        lambda: deps_of(slurm_client).inventory.ranks_of(created["id"], restart_epoch=0),
        lambda found: len(found) == 2 and all(rank.alive for rank in found.values()),
        timeout_s=15,
    )
    assert sorted(ranks) == [0, 1] and all(rank.alive and rank.pid for rank in ranks.values())
    nodes = {node["node_id"]: node for node in slurm_client.get("/v1/nodes").json()}
    assert set(nodes) == set(allocation.nodes)  # an agent on each allocated node, named after it, and nowhere else
    assert {name: (node["spare"], node["ranks"]) for name, node in nodes.items()} == {
        **{name: (False, 1) for name in workers},  # each worker runs its rank
        **{name: (True, 0) for name in spares},  # the spare waits
    }
    assert slurm_client.get("/v1/jobs").json()["data"][0]["backend"] == "slurm"


@pytest.mark.parametrize(
    ("slurm", "field"),
    [
        ({"sparez": 1}, "slurm.sparez"),
        ({"spares": 65}, "slurm.spares"),
        ({"spares": -1}, "slurm.spares"),
        ({"time_limit_min": 0}, "slurm.time_limit_min"),
        ({"partition": "gpu --uid=0"}, "slurm.partition"),
        ({"account": ""}, "slurm.account"),
        ({"extra_args": ["--export=ALL"]}, "slurm.extra_args.0"),  # Reprise sets it
        ({"extra_args": ["-w node1"]}, "slurm.extra_args.0"),  # one --name[=value] token only
        ({"extra_args": ["--gres=gpu:8\n#SBATCH --uid=0"]}, "slurm.extra_args.0"),
    ],
)
def test_a_bad_slurm_section_is_422_naming_the_field(
    nats_server: NatsServer, admin_client: Any, slurm: dict[str, object], field: str
) -> None:
    with admin_client(nats_server.url) as client:
        body = {"name": "x", "node_count": 1, "command": ["true"], "slurm": slurm}
        response = client.post("/v1/jobs", json=body)
    assert response.status_code == 422, response.text
    locations = [".".join(str(part) for part in error["loc"]) for error in response.json()["detail"]]
    assert any(location.endswith(field) for location in locations), locations


def allocation_ended(cluster: SlurmCluster, job_id: str) -> SlurmJob | None:
    """The job's allocation once it no longer runs (asserted by the caller)."""
    return poll(
        lambda: allocation_of(cluster, job_id),
        lambda found: found is not None and found.state is not SlurmJobState.RUNNING,
        timeout_s=30,
        interval_s=0.3,
    )


def test_a_node_slurm_sets_down_leaves_the_allocation_which_runs_on_with_its_other_agents(
    slurm_client: TestClient, slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """Reprise handles a lost node itself (a spare or a shrink, in seconds); Slurm, setting the node DOWN later, must
    not end the whole allocation and every surviving agent and rank with it (its default without --no-kill)."""
    job_id = submit(slurm_client, tmp_path, nodes=2, spares=0)["id"]
    running_job(slurm_client, job_id)
    before = allocation_of(slurm_cluster, job_id)
    assert before is not None
    survivor, lost = before.nodes

    slurm_cluster.kill_node(lost)
    poll(slurm_cluster.node_states, lambda states: states.get(lost, "").startswith("down"), timeout_s=45)

    after = poll(
        lambda: allocation_of(slurm_cluster, job_id),
        lambda job: job is not None and lost not in job.nodes,
        timeout_s=15,
    )
    assert after is not None and (after.job_id, after.state, after.restart_count) == (
        before.job_id,
        SlurmJobState.RUNNING,
        0,
    ), after  # the same allocation, still running, not requeued
    assert after.nodes == (survivor,)
    nodes = {node["node_id"]: node for node in slurm_client.get("/v1/nodes").json()}
    assert not nodes[survivor]["stale"] and nodes[survivor]["ranks"] == 1  # its agent and rank live on


def test_the_platforms_jobs_and_slurms_are_reconciled_both_ways(
    slurm_client: TestClient, slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    cancelled, lost = (submit(slurm_client, tmp_path, nodes=1, spares=0)["id"] for _ in range(2))
    for job_id in (cancelled, lost):
        running_job(slurm_client, job_id)

    assert slurm_client.post(f"/v1/jobs/{cancelled}/cancel").json()["state"] == "cancelled"
    as_admin(slurm_cluster, "scancel", "--name", allocation_name(lost))  # someone ends the allocation behind our back

    ended = allocation_ended(slurm_cluster, cancelled)  # the platform's cancel ended the allocation (scancel)
    assert ended is not None and ended.state in {SlurmJobState.CANCELLED, SlurmJobState.COMPLETING}, ended
    job = poll(lambda: slurm_client.get(f"/v1/jobs/{lost}").json(), lambda j: j["state"] != "running", timeout_s=30)
    assert job["state"] == "failed" and "slurm allocation is gone" in job["detail"], job


def test_a_pending_job_whose_agents_never_report_fails_naming_them_and_its_allocation_ends(
    slurm_cluster: SlurmCluster, nats_server: NatsServer, admin_client: Any, tmp_path: Path
) -> None:
    settings = slurm_settings(
        slurm_cluster,
        tmp_path,
        slurm_agent_command="sleep 300",  # an agent that never starts (a wrong path, a broken install)
        slurm_agent_start_timeout_s=3.0,
    )
    with admin_client(nats_server.url, **settings) as client:
        job_id = submit(client, tmp_path, nodes=2, spares=0)["id"]
        job = poll(lambda: client.get(f"/v1/jobs/{job_id}").json(), lambda j: j["state"] != "pending", timeout_s=45)
        assert job["state"] == "failed", job
        allocation = allocation_of(slurm_cluster, job_id)
        assert allocation is not None
        assert "did not report within 3 s" in job["detail"] and str(allocation.job_id) in job["detail"], job
        assert all(node in job["detail"] for node in allocation.nodes), job  # the silent nodes, by name
        ended = allocation_ended(slurm_cluster, job_id)  # the failed job's allocation is ended
    assert ended is not None and ended.state in {SlurmJobState.CANCELLED, SlurmJobState.COMPLETING}, ended


def test_a_restarted_orchestrator_reconciles_what_changed_while_it_was_down(
    slurm_cluster: SlurmCluster, nats_server: NatsServer, admin_client: Any, tmp_path: Path
) -> None:
    settings = slurm_settings(slurm_cluster, tmp_path)
    with admin_client(nats_server.url, **settings) as client:
        job_id = submit(client, tmp_path, nodes=1, spares=0)["id"]
        running_job(client, job_id)
    as_admin(slurm_cluster, "scancel", "--name", allocation_name(job_id))  # while no orchestrator runs
    assert allocation_ended(slurm_cluster, job_id) is not None

    with admin_client(nats_server.url, **settings) as client:  # the same database: a restart
        job = poll(lambda: client.get(f"/v1/jobs/{job_id}").json(), lambda j: j["state"] != "running", timeout_s=30)
    assert job["state"] == "failed" and "gone" in job["detail"], job


def test_an_allocation_slurm_refuses_is_a_409_and_fails_the_job(slurm_client: TestClient) -> None:
    body = {"name": "x", "node_count": 1, "command": SLEEPS, "slurm": {"partition": "nosuch", "output": "/dev/null"}}
    response = slurm_client.post("/v1/jobs", json=body)

    assert response.status_code == 409, response.text
    assert "refused its allocation" in response.json()["detail"] and "partition" in response.json()["detail"]
    (job,) = slurm_client.get("/v1/jobs").json()["data"]
    assert (job["state"], job["backend"]) == ("failed", "slurm") and job["detail"].startswith("not allocated: ")
    listed = {"name": "x", "nodes": ["node1"], "command": SLEEPS}
    assert slurm_client.post("/v1/jobs", json=listed).status_code == 409  # Slurm chooses the nodes


HEARTBEATS = [sys.executable, "-c", "import time\nfrom reprise_sdk import heartbeat\nstep = 0\nwhile True:\n"
              "    step += 1\n    heartbeat(step)\n    time.sleep(0.2)\n"]  # fmt: skip


async def _publish(url: str, incident: IncidentChange) -> None:
    bus = Bus(url=url, service="test-slurm-submit")
    await bus.connect(attempts=10)
    try:
        await bus.publish(subjects.incident(incident.job_id, "opened"), incident)
    finally:
        await bus.close()


def test_when_no_spare_is_left_the_allocation_is_requeued_without_the_drained_node_and_the_job_recovers(
    slurm_cluster: SlurmCluster, nats_server: NatsServer, admin_client: Any, registry: str, tmp_path: Path
) -> None:
    settings = {
        "compute_backend": "slurm",
        "slurm_conf": slurm_cluster.conf_path,
        "slurm_poll_interval_s": 0.5,
        "slurm_agent_command": AGENT,
        "slurm_agent_http_port": 0,
        "slurm_agent_env": {"REPRISE_GPU_COUNT": "1", "REPRISE_STATE_DIR": str(tmp_path / "agents")},
        "registry_url": registry,
        "stop_grace_s": 1.0,
    }
    policy = {"elastic_min_nodes": 2, "backoff_initial_s": 0, "placement_timeout_s": 90}
    slurm = {"spares": 0, "output": str(tmp_path / "slurm-%j.out")}
    body = {"name": "no-spare", "node_count": 2, "command": HEARTBEATS, "policy": policy, "slurm": slurm}
    with admin_client(nats_server.url, **settings) as client:
        job_id = client.post("/v1/jobs", json=body).raise_for_status().json()["id"]
        running_job(client, job_id)
        first = allocation_of(slurm_cluster, job_id)
        assert first is not None and len(first.nodes) == 2
        culprit = first.nodes[1]

        fault = incidents.gpu_fault(node_id=culprit, rank=1, incident_id="inc-nospare", job_id=job_id)
        asyncio.run(_publish(nats_server.url, fault))
        found = poll(
            lambda: client.get(f"/v1/jobs/{job_id}/recoveries").json()["data"],
            lambda r: bool(r) and r[0]["step"] in ("running", "failed", "held"),
            timeout_s=90,
            interval_s=0.5,
        )
        job = client.get(f"/v1/jobs/{job_id}").json()

    assert found and (found[0]["step"], found[0]["outcome"]) == ("running", "recovered"), found[:1]
    again = allocation_of(slurm_cluster, job_id)
    assert again is not None and again.job_id == first.job_id and again.restart_count == 1, again  # requeued
    assert culprit in again.excluded_nodes and culprit not in again.nodes
    nodes = [rank["node_id"] for rank in job["placement"]]
    assert (job["state"], job["restart_epoch"], len(nodes)) == ("running", 1, 2), job
    assert set(nodes) == set(again.nodes)  # the ranks run in the new allocation, on both its nodes
    assert sinfo_reasons(slurm_cluster)[culprit] == f"reprise: incident inc-nospare: {fault.root_cause}"
