"""The whole orchestrator on `REPRISE_COMPUTE_BACKEND=kubernetes`, against the real API server with the tests playing
the kubelet: a job's allocation is one pod per node whose agents run its ranks, and a GPU fault is one recovery that
cordons the node in Kubernetes (read back from the API server) and, with no spare left, replaces the node's pod by
one on a free node, where the job runs on."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from reprise_cli.client import poll
from reprise_cli.kube import apiserver_path
from reprise_cli.kube_server import KubeApiServer
from reprise_cli.servers import NatsServer, ServerProcess
from reprise_orchestrator.compute.kubernetes.api import KubeUnavailableError
from reprise_orchestrator.compute.kubernetes.backend import KubernetesBackend
from reprise_orchestrator.compute.kubernetes.cordon import INCIDENT_ANNOTATION, TAINT_KEY
from reprise_orchestrator.compute.kubernetes.pods import pod_name

from .. import incidents
from ..test_slurm_api import deps_of
from ..test_slurm_submit import HEARTBEATS, _publish, running_job
from .cluster import JOBS_NAMESPACE, unique
from .kubelet import KubeletThread
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


def test_a_gpu_fault_is_one_recovery_onto_a_new_pod(
    kube_server: KubeApiServer, nats_server: NatsServer, admin_client: Any, registry: str, tmp_path: Path
) -> None:
    label = unique("orch")
    nodes = [f"{label}-{i}" for i in range(3)]
    (tmp_path / "logs").mkdir()
    policy = {"elastic_min_nodes": 2, "backoff_initial_s": 0, "placement_timeout_s": 90}
    body = {
        "name": "on-kubernetes",
        "node_count": 2,
        "command": HEARTBEATS,
        "policy": policy,
        "kubernetes": {"spares": 0},
    }
    settings = kubernetes_settings(kube_server, label, tmp_path, registry)
    with (
        KubeletThread(
            kube_server, JOBS_NAMESPACE, {n: {POOL_LABEL: label} for n in nodes}, logs=tmp_path / "logs"
        ) as k,
        admin_client(nats_server.url, **settings) as client,
    ):
        backend = deps_of(client).compute
        assert isinstance(backend, KubernetesBackend)
        poll(lambda: _listed(backend), bool, timeout_s=15)  # until then a submission is a 503 (KubeUnavailableError)
        job_id = client.post("/v1/jobs", json=body).raise_for_status().json()["id"]
        job = running_job(client, job_id)
        assert [rank["node_id"] for rank in job["placement"]] == nodes[:2]
        assert k.kubelet is not None and len(k.kubelet.processes) == 2  # a pod, and its agent, on each of its nodes

        fault = incidents.gpu_fault(node_id=nodes[1], rank=1, incident_id="inc-k8s", job_id=job_id)
        asyncio.run(_publish(nats_server.url, fault))
        found = poll(
            lambda: client.get(f"/v1/jobs/{job_id}/recoveries").json()["data"],
            lambda r: bool(r) and r[0]["step"] in ("running", "failed", "held"),
            timeout_s=90,
            interval_s=0.5,
        )
        job = client.get(f"/v1/jobs/{job_id}").json()
        cordoned = k.call(k.admin.node(nodes[1]))  # type: ignore[union-attr]
        pods = poll(  # the culprit's pod ends (its kubelet stops its agent) and goes
            lambda: k.call(k.admin.core.list_namespaced_pod(JOBS_NAMESPACE)).items,  # type: ignore[union-attr]
            lambda items: pod_name(job_id, 1) not in {pod.metadata.name for pod in items},
            timeout_s=20,
        )

    assert [(r["step"], r["outcome"]) for r in found] == [("running", "recovered")]  # one recovery
    assert (job["state"], job["restart_epoch"]) == ("running", 1), job
    assert [rank["node_id"] for rank in job["placement"]] == [nodes[0], nodes[2]]
    assert cordoned.spec.unschedulable
    assert [(t.key, t.value) for t in cordoned.spec.taints] == [(TAINT_KEY, "inc-k8s")]
    assert cordoned.metadata.annotations[INCIDENT_ANNOTATION] == "inc-k8s"
    ours = {pod.metadata.name: pod.spec.node_name for pod in pods if pod.metadata.name.startswith(f"reprise-{job_id}")}
    assert ours == {pod_name(job_id, 0): nodes[0], pod_name(job_id, 2): nodes[2]}  # the culprit's pod replaced


def _listed(backend: KubernetesBackend) -> bool:
    """True once the backend's watches have listed the nodes and the pods."""
    try:
        backend.pods.all_pods()
    except KubeUnavailableError:
        return False
    return True


def test_the_api_server_restarted_mid_recovery_the_recovery_completes_once(
    kube_server: KubeApiServer, nats_server: NatsServer, admin_client: Any, registry: str, tmp_path: Path
) -> None:
    label = unique("restart")
    nodes = [f"{label}-{i}" for i in range(3)]
    (tmp_path / "logs").mkdir()
    policy = {"elastic_min_nodes": 2, "backoff_initial_s": 0, "placement_timeout_s": 90}
    body = {"name": "restarted", "node_count": 2, "command": HEARTBEATS, "policy": policy, "kubernetes": {"spares": 0}}
    settings = kubernetes_settings(kube_server, label, tmp_path, registry)
    with (
        KubeletThread(
            kube_server, JOBS_NAMESPACE, {n: {POOL_LABEL: label} for n in nodes}, logs=tmp_path / "logs"
        ) as k,
        admin_client(nats_server.url, **settings) as client,
    ):
        backend = deps_of(client).compute
        assert isinstance(backend, KubernetesBackend)
        poll(lambda: _listed(backend), bool, timeout_s=15)
        job_id = client.post("/v1/jobs", json=body).raise_for_status().json()["id"]
        running_job(client, job_id)

        ServerProcess.stop(kube_server)  # the API server alone goes away (etcd stays) ...
        try:
            fault = incidents.gpu_fault(node_id=nodes[1], rank=1, incident_id="inc-restart", job_id=job_id)
            asyncio.run(_publish(nats_server.url, fault))  # ... while a recovery must cordon and replace a pod
            stuck = poll(lambda: client.get(f"/v1/jobs/{job_id}/recoveries").json()["data"], bool, timeout_s=30)
            time.sleep(3.0)
            during = client.get(f"/v1/jobs/{job_id}/recoveries").json()["data"]
        finally:
            kube_server._launch("kube-apiserver", [str(apiserver_path()), *kube_server._flags()], timeout_s=60)
        found = poll(
            lambda: client.get(f"/v1/jobs/{job_id}/recoveries").json()["data"],
            lambda r: bool(r) and r[0]["step"] in ("running", "failed", "held"),
            timeout_s=90,
            interval_s=0.5,
        )
        job = client.get(f"/v1/jobs/{job_id}").json()
        cordoned = k.call(k.admin.node(nodes[1]))  # type: ignore[union-attr]

    assert len(stuck) == 1 and during[0]["step"] not in ("running", "failed", "held"), during[:1]  # it waited
    assert [(r["step"], r["outcome"]) for r in found] == [("running", "recovered")], found  # once
    assert (job["state"], job["restart_epoch"]) == ("running", 1), job
    assert [rank["node_id"] for rank in job["placement"]] == [nodes[0], nodes[2]]
    assert cordoned.spec.unschedulable and cordoned.metadata.annotations[INCIDENT_ANNOTATION] == "inc-restart"
