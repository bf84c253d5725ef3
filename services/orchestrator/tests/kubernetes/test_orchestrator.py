"""The whole orchestrator on `REPRISE_COMPUTE_BACKEND=kubernetes`, against the real API server with the kubelet
double (reprise_cli.kubelet): a job's allocation is one pod per node whose agents run its ranks, and a GPU fault is one
recovery that cordons the node in Kubernetes (read back from the API server) and, with no spare left, replaces the
node's pod by one on a free node, where the job runs on."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from reprise_cli.client import poll
from reprise_cli.kube import apiserver_path
from reprise_cli.kube_server import KubeApiServer
from reprise_cli.kubelet import KubeletThread, register_node
from reprise_cli.servers import NatsServer, ServerProcess
from reprise_orchestrator.compute.kubernetes.api import KubeUnavailableError
from reprise_orchestrator.compute.kubernetes.backend import KubernetesBackend
from reprise_orchestrator.compute.kubernetes.cordon import INCIDENT_ANNOTATION, TAINT_KEY
from reprise_orchestrator.compute.kubernetes.pods import pod_name

from .. import incidents
from ..test_slurm_api import deps_of
from ..test_slurm_submit import HEARTBEATS, _publish, running_job
from .cluster import JOBS_NAMESPACE, unique
from .test_job_pods import AGENT
from .test_node_watch import POOL_LABEL


def kubernetes_settings(server: KubeApiServer, label: str, tmp_path: Path, registry: str) -> dict[str, Any]:
    """The orchestrator's settings for the session's API server, as the backend's identity, on the test's nodes."""
    token = tmp_path / "token"
    token.write_text(server.backend_token)
    return {
        "compute_backend": "kubernetes",
        "kubernetes_api_url": server.url,
        "kubernetes_token_file": token,
        "kubernetes_ca_file": server.ca_file,
        "kubernetes_node_selector": f"{POOL_LABEL}={label}",
        "slurm_agent_command": AGENT,
        "slurm_agent_http_port": 0,
        "slurm_agent_env": {"REPRISE_GPU_COUNT": "1", "REPRISE_STATE_DIR": str(tmp_path / "agents")},
        "registry_url": registry,
        "stop_grace_s": 1.0,
    }


@dataclass
class Running:
    """A job of 2 nodes running on the orchestrator (the TestClient's loop), and the kubelet double of the test's 3
    nodes (a loop of its own)."""

    kubelet: KubeletThread
    client: TestClient
    nats_url: str
    nodes: list[str]
    job_id: str
    job: dict[str, Any]

    def get(self, path: str) -> dict[str, Any]:
        """What the API server has at `path` (JSON), read as the admin."""
        assert self.kubelet.api is not None
        return self.kubelet.call(self.kubelet.api.call("GET", path))

    def fault(self, node: str, incident_id: str) -> None:
        """A GPU fault of rank 1's, on `node`, as the detector publishes it."""
        fault = incidents.gpu_fault(node_id=node, rank=1, incident_id=incident_id, job_id=self.job_id)
        asyncio.run(_publish(self.nats_url, fault))

    def recoveries(self) -> list[dict[str, Any]]:
        """The job's recoveries."""
        found: list[dict[str, Any]] = self.client.get(f"/v1/jobs/{self.job_id}/recoveries").json()["data"]
        return found

    def recoveries_once_ended(self) -> list[dict[str, Any]]:
        """The job's recoveries once the first has ended."""
        found: list[dict[str, Any]] = poll(
            self.recoveries,
            lambda r: bool(r) and r[0]["step"] in ("running", "failed", "held"),
            timeout_s=90,
            interval_s=0.5,
        )
        return found


@contextmanager
def running(
    server: KubeApiServer, nats_server: NatsServer, admin_client: Any, registry: str, tmp_path: Path, *, name: str
) -> Iterator[Running]:
    """A job `name` of 2 nodes and no spare, running, in a pool of 3 nodes of the test's own run by the kubelet double
    (started first)."""
    label = unique(name)
    nodes = [f"{label}-{i}" for i in range(3)]
    policy = {"elastic_min_nodes": 2, "backoff_initial_s": 0, "placement_timeout_s": 90}
    body = {"name": name, "node_count": 2, "command": HEARTBEATS, "policy": policy, "kubernetes": {"spares": 0}}
    kubelet = KubeletThread(
        server.url, server.admin_token, server.ca_file, JOBS_NAMESPACE, set(nodes), logs=tmp_path / "logs"
    )
    try:
        api = kubelet.open()
        for node in nodes:
            kubelet.call(register_node(api, node, labels={POOL_LABEL: label}))
        kubelet.start()
        with admin_client(nats_server.url, **kubernetes_settings(server, label, tmp_path, registry)) as client:
            backend = deps_of(client).compute
            assert isinstance(backend, KubernetesBackend)
            poll(lambda: _listed(backend), bool, timeout_s=15)  # until then a submission is a 503
            job_id = client.post("/v1/jobs", json=body).raise_for_status().json()["id"]
            job = running_job(client, job_id)
            yield Running(kubelet, client, nats_server.url, nodes, job_id, job)
    finally:
        kubelet.stop()


def _listed(backend: KubernetesBackend) -> bool:
    """True once the backend's watches have listed the nodes and the pods."""
    try:
        backend.pods.all_pods()
    except KubeUnavailableError:
        return False
    return True


def test_a_gpu_fault_is_one_recovery_onto_a_new_pod(
    kube_server: KubeApiServer, nats_server: NatsServer, admin_client: Any, registry: str, tmp_path: Path
) -> None:
    with running(kube_server, nats_server, admin_client, registry, tmp_path, name="on-kubernetes") as run:
        nodes, job_id = run.nodes, run.job_id
        assert [rank["node_id"] for rank in run.job["placement"]] == nodes[:2]
        kubelet = run.kubelet.kubelet
        assert kubelet is not None and len(kubelet.processes) == 2  # a pod, and its agent, on each of its nodes

        run.fault(nodes[1], "inc-k8s")
        found = run.recoveries_once_ended()
        job = run.client.get(f"/v1/jobs/{job_id}").json()
        cordoned = run.get(f"/api/v1/nodes/{nodes[1]}")
        pods = poll(  # the culprit's pod ends (its kubelet stops its agent) and goes
            lambda: run.get(f"/api/v1/namespaces/{JOBS_NAMESPACE}/pods")["items"],
            lambda items: pod_name(job_id, 1) not in {pod["metadata"]["name"] for pod in items},
            timeout_s=20,
        )

    assert [(r["step"], r["outcome"]) for r in found] == [("running", "recovered")]  # one recovery
    assert (job["state"], job["restart_epoch"]) == ("running", 1), job
    assert [rank["node_id"] for rank in job["placement"]] == [nodes[0], nodes[2]]
    assert cordoned["spec"]["unschedulable"]
    assert [(t["key"], t.get("value")) for t in cordoned["spec"]["taints"]] == [(TAINT_KEY, "inc-k8s")]
    assert cordoned["metadata"]["annotations"][INCIDENT_ANNOTATION] == "inc-k8s"
    ours = {
        p["metadata"]["name"]: p["spec"]["nodeName"]
        for p in pods
        if p["metadata"]["name"].startswith(f"reprise-{job_id}")
    }
    assert ours == {pod_name(job_id, 0): nodes[0], pod_name(job_id, 2): nodes[2]}  # the culprit's pod replaced


def test_the_api_server_restarted_mid_recovery_the_recovery_completes_once(
    kube_server: KubeApiServer, nats_server: NatsServer, admin_client: Any, registry: str, tmp_path: Path
) -> None:
    with running(kube_server, nats_server, admin_client, registry, tmp_path, name="restarted") as run:
        nodes, job_id = run.nodes, run.job_id
        ServerProcess.stop(kube_server)  # the API server alone goes away (etcd stays) ...
        try:
            run.fault(nodes[1], "inc-restart")  # ... while a recovery must cordon and replace a pod
            stuck = poll(run.recoveries, bool, timeout_s=30)
            time.sleep(3.0)
            during = run.recoveries()
        finally:
            kube_server._launch("kube-apiserver", [str(apiserver_path()), *kube_server._flags()], timeout_s=60)
        found = run.recoveries_once_ended()
        job = run.client.get(f"/v1/jobs/{job_id}").json()
        cordoned = run.get(f"/api/v1/nodes/{nodes[1]}")

    assert len(stuck) == 1 and during[0]["step"] not in ("running", "failed", "held"), during[:1]  # it waited
    assert [(r["step"], r["outcome"]) for r in found] == [("running", "recovered")], found  # once
    assert (job["state"], job["restart_epoch"]) == ("running", 1), job
    assert [rank["node_id"] for rank in job["placement"]] == [nodes[0], nodes[2]]
    assert (
        cordoned["spec"]["unschedulable"] and cordoned["metadata"]["annotations"][INCIDENT_ANNOTATION] == "inc-restart"
    )
