"""Issue 43 end to end: what Kubernetes itself does to a running job is one incident and one recovery.

One stack on Kubernetes (a real etcd and kube-apiserver, the kubelet double, every service), 3 worker Nodes and a
spare, shared by the cases. Each case runs a job of 2 nodes (one rank each; one pod per node, and a spare's pod) and
then acts as someone other than Reprise would, as the cluster's admin, straight on the API server (the stack's
kubeconfig) or on the pod's processes:

- a job's pod deleted (`kubectl delete pod`): the kubelet ends the agent cleanly (SIGTERM; it says goodbye), so the
  backend's `node_fail` signal is Reprise's only word of it;
- a pod's container killed outright (SIGKILL to the agent and its ranks, as the OOM killer ends a container), under
  the demo's DDP job: the pod fails (`node_fail`), and the agent's connection closes without a goodbye while the
  survivor's collective fails (the detector's own `node.lost`). The two race: never two incidents;
- a job's Node turned NotReady through the status subresource, as the node-lifecycle controller writes it: the
  backend's `node_down` signal is the only word of it (the pod's agent keeps running).

Each must become exactly one incident naming the node (a node fault: the node is left out), and exactly one recovery
that ends `recovered` with the job on the spare's pod and training advancing there; nothing more follows within a
settle time.
"""

from __future__ import annotations

import json
import os
import signal
import ssl
import sys
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from reprise_cli.client import PlatformClient, poll
from reprise_cli.demo.training import Training, job_spec
from reprise_cli.kube_cluster import JOBS_NAMESPACE, kube_unavailable_reason, listening_ports
from reprise_cli.stack import Stack
from reprise_cli.topology import StackConfig
from reprise_common.errors import ConfigError

pytest.importorskip("torch", reason="PyTorch is not installed: the DDP job cannot run")
pytestmark = [
    pytest.mark.stack,
    pytest.mark.timeout(300),
    pytest.mark.skipif(kube_unavailable_reason() is not None, reason=f"no kube-apiserver: {kube_unavailable_reason()}"),
]

# Longer than anything that could still turn the fault into a second incident: the detector's node loss (5 s of
# silence, 0.3 s after a closed connection), a rank's early exit, and the pod watch's resumption.
SETTLE_S = 6.0
JOB_LABEL = "reprise.dev/job"
SPARE_LABEL = "reprise.dev/spare"


class Admin:
    """The cluster's admin on the API server (the stack's kubeconfig): someone other than Reprise."""

    def __init__(self, kubeconfig: Path) -> None:
        config = json.loads(kubeconfig.read_text())
        cluster, user = config["clusters"][0]["cluster"], config["users"][0]["user"]
        verify = ssl.create_default_context(cafile=cluster["certificate-authority"])
        headers = {"Authorization": f"Bearer {user['token']}"}
        self.http = httpx.Client(base_url=cluster["server"], headers=headers, verify=verify, timeout=10.0)

    def close(self) -> None:
        """Close the connections."""
        self.http.close()

    def pods(self, job_id: str) -> list[dict[str, Any]]:
        """The job's pods in the jobs' namespace."""
        params = {"labelSelector": f"{JOB_LABEL}={job_id}"}
        answer = self.http.get(f"/api/v1/namespaces/{JOBS_NAMESPACE}/pods", params=params).raise_for_status()
        return list(answer.json()["items"])

    def delete_pod(self, name: str) -> None:
        """`kubectl delete pod` (graceful: the kubelet ends the process, then removes the pod)."""
        self.http.delete(f"/api/v1/namespaces/{JOBS_NAMESPACE}/pods/{name}").raise_for_status()

    def set_ready(self, node: str, status: str, *, reason: str) -> None:
        """The Node's Ready condition, written through the status subresource as the node controller writes it."""
        found = self.http.get(f"/api/v1/nodes/{node}").raise_for_status().json()
        kept = [c for c in found["status"].get("conditions", []) if c["type"] != "Ready"]
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        ready = {"type": "Ready", "status": status, "reason": reason, "message": reason}
        body = {"status": {"conditions": [*kept, ready | {"lastTransitionTime": now, "lastHeartbeatTime": now}]}}
        headers = {"Content-Type": "application/merge-patch+json"}
        self.http.patch(f"/api/v1/nodes/{node}/status", content=json.dumps(body), headers=headers).raise_for_status()


@dataclass
class Cluster:
    """The shared stack, a client of the platform and the admin."""

    stack: Stack
    client: PlatformClient
    admin: Admin
    work_dir: Path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One stack on Kubernetes for the three cases: node-1..3 (workers) and spare-1, simulated GPUs."""
    root = tmp_path_factory.mktemp("kube-signals")
    config = StackConfig(nodes=3, spares=1, gpus_per_node=2, state_dir=root / "state", scheduler="kubernetes")
    stack = Stack(config, free_ports=True)
    try:
        stack.start(timeout_s=90)
        assert stack.kube is not None
        with closing(stack.client()) as client:
            admin = Admin(stack.kube.kubeconfig)
            try:
                yield Cluster(stack, client, admin, root)
            finally:
                admin.close()
    finally:
        stack.stop()


@dataclass
class RunningJob:
    """A job whose pods run: its record, its workers' nodes (rank order) and its spare's node."""

    job: dict[str, Any]
    workers: list[str]
    spare: str

    @property
    def id(self) -> str:
        """The job's id."""
        return str(self.job["id"])


def _start_job(cluster: Cluster, name: str, *, ddp: bool = False) -> RunningJob:
    """A job on 2 nodes (+1 spare pod), once its allocation runs and rank 0 is stepping: the ticker (a rank per node
    that needs no other), or with `ddp` the demo's DDP job, whose ranks fail together in their collectives."""
    client, admin = cluster.client, cluster.admin
    assert cluster.stack.kube is not None
    poll(cluster.stack.kube.pods, lambda pods: not pods, timeout_s=30)  # a previous case's pods are gone
    for node in client.nodes():  # a node a previous case's recovery cordoned takes part again
        if node["cordoned"]:
            client.uncordon(node["node_id"])
    work_dir = cluster.work_dir / name
    work_dir.mkdir()
    if ddp:
        training = Training(steps=100_000, checkpoint_every=20)
        spec = job_spec(training, name=name, nodes=2, min_nodes=2, work_dir=work_dir, hang_timeout_s=15)
    else:
        ticker = [sys.executable, "-m", "reprise_cli.workloads.ticker"]
        spec = {"name": name, "node_count": 2, "ranks_per_node": 1, "command": ticker, "working_dir": str(work_dir)}
        spec["policy"] = {"elastic_min_nodes": 2, "hang_timeout_s": 15, "backoff_initial_s": 0}
    submitted = client.submit(spec)
    job = poll(lambda: client.job(submitted["id"]), lambda j: j["state"] != "pending", timeout_s=60)
    assert job["state"] == "running", (job["state"], job["detail"], job["placement"])
    workers = [r["node_id"] for r in sorted(job["placement"], key=lambda r: r["rank"])]
    pods = admin.pods(job["id"])
    spares = [p["spec"]["nodeName"] for p in pods if p["metadata"]["labels"][SPARE_LABEL] == "true"]
    assert len(spares) == 1 and len(pods) == 3, [(p["metadata"]["name"], p["spec"]["nodeName"]) for p in pods]
    running = RunningJob(job, workers, spares[0])
    _wait_for_steps(cluster, running.job, node=workers[0], epoch=0, past=3)
    return running


def _rank_step(cluster: Cluster, job_id: str, *, node: str, epoch: int) -> int | None:
    """The last step a rank of the job's launch `epoch` on `node` completed, as its agent reports (None: not yet)."""
    try:
        status = httpx.get(cluster.stack.agent_url(node) + "/v1/status", timeout=2.0).raise_for_status().json()
    except (httpx.HTTPError, ValueError, LookupError, ConfigError):
        return None  # the pod's agent is starting (no port yet), or gone
    steps = [r.get("step") for r in status["ranks"] if r.get("job_id") == job_id and r.get("restart_epoch") == epoch]
    return max((s for s in steps if s is not None), default=None)


def _wait_for_steps(cluster: Cluster, job: dict[str, Any], *, node: str, epoch: int, past: int) -> int:
    """Until the job's rank on `node` in launch `epoch` is past step `past`; that step."""
    step = poll(
        lambda: _rank_step(cluster, job["id"], node=node, epoch=epoch),
        lambda s: s is not None and s > past,
        timeout_s=60,
        interval_s=0.25,
    )
    assert step is not None
    return step


def _one_recovery(cluster: Cluster, running: RunningJob, *, culprit: str) -> list[dict[str, Any]]:
    """The fault's one incident (a node fault: the node left out) and its one recovery, finished `recovered` with the
    spare's pod in the culprit's place and training advancing there; still only those after the settle time. The
    incident's symptoms."""
    client, job_id = cluster.client, running.id
    recoveries = poll(
        lambda: client.recoveries(job_id), lambda r: any(x.get("outcome") for x in r), timeout_s=90, interval_s=0.25
    )
    incidents = client.incidents(job_id)
    assert len(incidents) == 1, json.dumps(incidents, indent=1)
    assert len(recoveries) == 1, json.dumps(recoveries, indent=1)
    incident, recovery = incidents[0], recoveries[0]
    assert (incident["culprit_node_id"], incident["category"]) == (culprit, "node"), incident
    assert incident["recommended_action"] == "restart_exclude_node", incident
    assert recovery["incident_id"] == incident["id"]
    assert recovery["outcome"] == "recovered", json.dumps(recovery, indent=1)
    placing = next(s for s in recovery["steps"] if s["step"] == "placing")["data"]
    assert placing["replaced"] == {culprit: running.spare}, placing

    job = client.job(job_id)
    assert job["state"] == "running" and job["restart_epoch"] >= 1, job
    assert {r["node_id"] for r in job["placement"]} == {running.workers[0], running.spare}, job["placement"]
    first = _wait_for_steps(cluster, job, node=running.spare, epoch=job["restart_epoch"], past=0)
    _wait_for_steps(cluster, job, node=running.spare, epoch=job["restart_epoch"], past=first + 3)

    time.sleep(SETTLE_S)
    assert [i["id"] for i in client.incidents(job_id)] == [incident["id"]], json.dumps(client.incidents(job_id))
    assert [r["id"] for r in client.recoveries(job_id)] == [recovery["id"]], json.dumps(client.recoveries(job_id))
    assert client.job(job_id)["restart_epoch"] == job["restart_epoch"]
    detail = client.http.get(f"{client.detector}/v1/incidents/{incident['id']}").raise_for_status().json()
    symptoms: list[dict[str, Any]] = detail["symptoms"]
    print("symptoms:", [(s["kind"], s["node_id"], s["detail"][:160]) for s in symptoms])
    return symptoms


def _kinds(symptoms: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Each symptom's kind and, for the backend's signals, which signal (`kubernetes node_fail: ...`)."""
    return sorted((s["kind"], s["detail"].split(":")[0] if s["kind"] == "compute.signal" else "") for s in symptoms)


def test_a_pod_deleted_by_someone_else_is_one_incident_and_one_recovery(cluster: Cluster) -> None:
    running = _start_job(cluster, "pod-deleted")
    culprit = running.workers[1]
    try:
        (victim,) = [p for p in cluster.admin.pods(running.id) if p["spec"]["nodeName"] == culprit]
        cluster.admin.delete_pod(victim["metadata"]["name"])

        symptoms = _one_recovery(cluster, running, culprit=culprit)
        # The agent was stopped cleanly (SIGTERM, its goodbye said): the backend's signal is the only word of it.
        assert ("compute.signal", "kubernetes node_fail") in _kinds(symptoms), symptoms
    finally:
        cluster.client.cancel(running.id)


def _container_of(cluster: Cluster, job_id: str, node: str) -> list[int]:
    """The processes of the job's pod on `node`: its agent (found by the port it serves on, with the pod's node and
    job in its environment) and every process under it, as a container's cgroup holds them."""
    port = int(cluster.stack.agent_url(node).rsplit(":", 1)[1])
    parents: dict[int, int] = {}
    agent = None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        mine = f"REPRISE_NODE_ID={node}".encode() in environ and any(job_id.encode() in v for v in environ)
        if mine and port in listening_ports(int(entry.name)):
            agent = int(entry.name)
    assert agent is not None, f"no agent of {job_id} serves on {node}"
    tree, grown = {agent}, True
    while grown:
        below = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= below
        grown = bool(below)
    return sorted(tree)


def test_a_container_killed_outright_is_one_incident_and_one_recovery(cluster: Cluster) -> None:
    running = _start_job(cluster, "container-killed", ddp=True)
    culprit = running.workers[1]
    try:
        for pid in _container_of(cluster, running.id, culprit):
            os.kill(pid, signal.SIGKILL)

        symptoms = _one_recovery(cluster, running, culprit=culprit)
        # Reprise's own `node.lost` (the survivor's collective failed, the agent's connection closed) and the backend's
        # signal race. Whichever comes while the node is still the job's joins the one incident; one that comes after
        # the recovery left the node out (as soon as 50 ms after the first) counts for no job. Never a second one.
        assert ("compute.signal", "kubernetes node_fail") in _kinds(symptoms), symptoms
    finally:
        cluster.client.cancel(running.id)


def test_a_node_turned_not_ready_is_one_incident_and_one_recovery(cluster: Cluster) -> None:
    running = _start_job(cluster, "node-not-ready")
    culprit = running.workers[1]
    try:
        cluster.admin.set_ready(culprit, "False", reason="KubeletNotReady")

        symptoms = _one_recovery(cluster, running, culprit=culprit)
        # The node's agent runs on: the backend's one `node_down` is the whole of it (docs/kubernetes.md: Ready=False).
        assert _kinds(symptoms) == [("compute.signal", "kubernetes node_down")], symptoms
    finally:
        cluster.client.cancel(running.id)
        cluster.admin.set_ready(culprit, "True", reason="KubeletReady")
