"""A job's pods on the real API server, with the kubelet double (reprise_cli.kubelet): an allocation binds one pod
per node to free labelled nodes and each pod's agent (this checkout's, as a local process) reports on NATS; a pod
deleted by someone else, evicted or OOM-killed is exactly one signal; releasing the job deletes its pods with none."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import nats
import pytest
from nats.aio.msg import Msg

from reprise_cli.kube_server import KubeApiServer
from reprise_cli.kubelet import KubeHttp, Kubelet
from reprise_cli.servers import NatsServer
from reprise_common import subjects
from reprise_common.events import ComputeSignal, ComputeSignalKind
from reprise_orchestrator.compute.allocation import AgentLaunch, AllocationRequest, AllocationState
from reprise_orchestrator.compute.kubernetes.api import KubeApi, KubeError
from reprise_orchestrator.compute.kubernetes.backend import KubernetesBackend
from reprise_orchestrator.compute.kubernetes.jobpods import PodSettings
from reprise_orchestrator.compute.kubernetes.models import KubernetesSpec
from reprise_orchestrator.compute.kubernetes.pods import JOB_LABEL, SPARE_LABEL, pod_name

from .cluster import JOBS_NAMESPACE, OTHER_NAMESPACE, Admin, unique
from .conftest import backend_access, open_backend
from .test_node_watch import POOL_LABEL, until

AGENT = str(Path(sys.executable).parent / "reprise-agent")


@dataclass
class Stage:
    """The backend watching a pool of three nodes of its own, their kubelet, and what came out: signals, reports."""

    backend: KubernetesBackend
    kubelet: Kubelet
    nodes: list[str]
    signals: list[ComputeSignal] = field(default_factory=list)
    reporting: set[str] = field(default_factory=set)

    async def emit(self, signal: ComputeSignal) -> None:
        self.signals.append(signal)

    def phases(self, job_id: str) -> dict[str, str]:
        return {pod.name: "live" if pod.live else "ended" for pod in self.backend.pods.of_job(job_id)}


def pod_settings(nats_url: str, tmp_path: Path) -> PodSettings:
    """The agents' launch as an operator would set it (simulated GPUs, any free HTTP port: they share this host)."""
    env = {"REPRISE_GPU_COUNT": "1", "REPRISE_REPORT_INTERVAL_S": "0.5", "REPRISE_STATE_DIR": str(tmp_path / "agents")}
    launch = AgentLaunch(command=AGENT, nats_url=nats_url, http_port=0, env=env)
    return PodSettings(launch=launch, image="reprise-agent:test", namespaces=(JOBS_NAMESPACE,))


@pytest.fixture
async def stage(
    kube_server: KubeApiServer, admin: Admin, nats_server: NatsServer, tmp_path: Path
) -> AsyncIterator[Stage]:
    label = unique("pods")
    nodes = [f"{label}-{i}" for i in range(3)]
    for name in nodes:
        await admin.create_node(name, labels={POOL_LABEL: label})
    backend = open_backend(
        KubeApi(backend_access(kube_server)),
        tmp_path,
        label_selector=f"{POOL_LABEL}={label}",
        pods=pod_settings(nats_server.url, tmp_path),
    )
    (tmp_path / "logs").mkdir()
    api = KubeHttp(kube_server.url, kube_server.admin_token, kube_server.ca_file)
    kubelet = Kubelet(api, JOBS_NAMESPACE, set(nodes), logs=tmp_path / "logs")
    found = Stage(backend=backend, kubelet=kubelet, nodes=nodes)
    connection = await nats.connect(nats_server.url)

    async def reported(msg: Msg) -> None:
        found.reporting.add(subjects.node_from_agent_subject(msg.subject))

    await connection.subscribe(subjects.AGENT_REPORTS, cb=reported)
    await kubelet.start()
    watching = asyncio.create_task(backend.watch(found.emit))
    await until(lambda: backend.pods.watches[JOBS_NAMESPACE].resource_version is not None)
    yield found
    watching.cancel()
    await asyncio.gather(watching, return_exceptions=True)
    await kubelet.stop()
    await api.close()
    await connection.close()
    await backend.close()


async def allocated(stage: Stage, *, workers: int, spares: int = 0) -> str:
    """A job's allocation, once its pods run and their agents report."""
    job_id = unique("job")
    await stage.backend.allocate(AllocationRequest(job_id=job_id, workers=workers, spares=spares))
    await until(lambda: len(stage.kubelet.processes) >= workers + spares)
    await until(lambda: stage.backend.pods.nodes_of(job_id) <= stage.reporting and len(stage.phases(job_id)) > 0)
    return job_id


async def test_an_allocation_binds_a_pod_per_node_and_their_agents_report(admin: Admin, stage: Stage) -> None:
    job_id = await allocated(stage, workers=2, spares=1)

    pods = (await admin.core.list_namespaced_pod(JOBS_NAMESPACE, label_selector=f"{JOB_LABEL}={job_id}")).items
    placed = {pod.metadata.name: (pod.spec.node_name, pod.metadata.labels[SPARE_LABEL]) for pod in pods}
    assert placed == {
        pod_name(job_id, 0): (stage.nodes[0], "false"),
        pod_name(job_id, 1): (stage.nodes[1], "false"),
        pod_name(job_id, 2): (stage.nodes[2], "true"),
    }
    assert {pod.status.phase for pod in pods} == {"Running"}  # as the kubelet wrote it
    assert set(stage.nodes) <= stage.reporting  # each pod's agent reports as its node
    allocation = (await stage.backend.allocations())[job_id]
    assert (allocation.state, allocation.nodes) == (AllocationState.RUNNING, tuple(stage.nodes))
    with pytest.raises(KubeError, match="needs 1 nodes; 0 labelled, schedulable and free"):
        await stage.backend.allocate(AllocationRequest(job_id=unique("job"), workers=1, spares=0))
    assert stage.signals == []


async def test_a_pod_deleted_by_someone_else_is_one_signal(admin: Admin, stage: Stage) -> None:
    job_id = await allocated(stage, workers=2)
    victim = pod_name(job_id, 0)

    await admin.core.delete_namespaced_pod(victim, JOBS_NAMESPACE)  # graceful: its kubelet ends it, then removes it
    await until(lambda: victim not in stage.backend.pods.watches[JOBS_NAMESPACE].objects)
    await asyncio.sleep(1.0)

    assert [(s.kind, s.node_id, s.job_id) for s in stage.signals] == [
        (ComputeSignalKind.NODE_FAIL, stage.nodes[0], job_id)
    ]
    assert "deleted by someone else" in stage.signals[0].detail
    assert stage.backend.pods.nodes_of(job_id) == {stage.nodes[1]}


async def test_an_evicted_pod_and_an_oom_killed_one_are_one_signal_each(admin: Admin, stage: Stage) -> None:
    job_id = await allocated(stage, workers=2)

    await stage.kubelet.evict(pod_name(job_id, 0))
    await stage.kubelet.oom_kill(pod_name(job_id, 1))
    await until(lambda: len(stage.signals) >= 2)
    await admin.core.delete_namespaced_pod(pod_name(job_id, 0), JOBS_NAMESPACE)  # an ended pod cleaned up: no more
    await until(lambda: pod_name(job_id, 0) not in stage.backend.pods.watches[JOBS_NAMESPACE].objects)
    await asyncio.sleep(1.0)

    assert sorted((s.node_id or "", s.detail.split(": ", 1)[1]) for s in stage.signals) == [
        (stage.nodes[0], "evicted: The node was low on resource: memory."),
        (stage.nodes[1], "the agent was OOM-killed (exit code 137)"),
    ]
    assert len({signal.event_id for signal in stage.signals}) == 2
    assert (await stage.backend.allocations())[job_id].state is AllocationState.ENDED


async def test_releasing_a_job_deletes_its_pods_without_a_signal(admin: Admin, stage: Stage) -> None:
    job_id = await allocated(stage, workers=2)
    processes = list(stage.kubelet.processes.values())

    assert sorted(await stage.backend.cancel(job_id)) == [0, 1]
    await until(lambda: job_id not in stage.backend.pods.allocations())

    assert (await admin.core.list_namespaced_pod(JOBS_NAMESPACE, label_selector=f"{JOB_LABEL}={job_id}")).items == []
    assert all(process.returncode is not None for process in processes)  # the agents ended with their pods
    assert stage.signals == []
    assert stage.backend.pods.free_nodes({}) == stage.nodes  # free for the next job


async def test_pods_one_replica_releases_are_no_signal_on_another(
    kube_server: KubeApiServer, stage: Stage, nats_server: NatsServer, tmp_path: Path
) -> None:
    """Replicas share the pods: what one deletes as released, another's watch must not take for a fault."""
    other = open_backend(
        KubeApi(backend_access(kube_server)),
        tmp_path / "replica-2",
        label_selector=stage.backend.nodes.label_selector,
        pods=pod_settings(nats_server.url, tmp_path),
    )
    seen: list[ComputeSignal] = []

    async def emit(signal: ComputeSignal) -> None:
        seen.append(signal)

    watching = asyncio.create_task(other.watch(emit))
    try:
        await until(lambda: other.pods.watches[JOBS_NAMESPACE].resource_version is not None)
        job_id = await allocated(stage, workers=2)
        await until(lambda: len(other.pods.of_job(job_id)) == 2)

        await stage.backend.cancel(job_id)
        await until(lambda: job_id not in other.pods.allocations())
        await asyncio.sleep(1.0)
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
        await other.close()
    assert (stage.signals, seen) == ([], [])


async def test_a_preempted_pod_is_one_preempted_signal(admin: Admin, stage: Stage) -> None:
    job_id = await allocated(stage, workers=1)

    await stage.kubelet.mark_preempted(pod_name(job_id, 0))  # the scheduler marks its victim, then deletes it
    await admin.core.delete_namespaced_pod(pod_name(job_id, 0), JOBS_NAMESPACE)
    await until(lambda: pod_name(job_id, 0) not in stage.backend.pods.watches[JOBS_NAMESPACE].objects)
    await asyncio.sleep(1.0)

    assert [(s.kind, s.node_id, s.job_id) for s in stage.signals] == [
        (ComputeSignalKind.PREEMPTED, stage.nodes[0], job_id)
    ]


async def test_a_requeue_replaces_a_failed_pod_once(admin: Admin, stage: Stage) -> None:
    job_id = await allocated(stage, workers=2)
    await stage.kubelet.evict(pod_name(job_id, 0))
    await until(lambda: stage.backend.pods.nodes_of(job_id) == {stage.nodes[1]})

    assert await stage.backend.requeue(job_id) == [stage.nodes[0]]
    assert await stage.backend.requeue(job_id) is None  # read from the server: nothing left to replace

    await until(lambda: stage.backend.pods.nodes_of(job_id) == {stage.nodes[1], stage.nodes[2]})
    new = await admin.core.read_namespaced_pod(pod_name(job_id, 2), JOBS_NAMESPACE)
    assert (new.spec.node_name, new.metadata.labels[SPARE_LABEL]) == (stage.nodes[2], "true")
    await until(lambda: stage.nodes[2] in stage.reporting)  # its agent reports, as a spare the recovery can take
    assert len(stage.signals) == 1  # the eviction; the replaced pod's deletion is Reprise's own


async def test_a_jobs_section_places_its_pods_and_another_namespace_is_refused(admin: Admin, stage: Stage) -> None:
    label = stage.nodes[0].rsplit("-", 1)[0]
    section = KubernetesSpec(node_selector={POOL_LABEL: label}, service_account="trainer")
    job_id = unique("job")
    await stage.backend.allocate(AllocationRequest(job_id=job_id, workers=1, spares=0, section=section))

    pod = await admin.core.read_namespaced_pod(pod_name(job_id, 0), JOBS_NAMESPACE)
    assert (pod.spec.node_selector, pod.spec.service_account_name) == ({POOL_LABEL: label}, "trainer")
    assert pod.spec.restart_policy == "Never" and pod.spec.automount_service_account_token is False
    elsewhere = KubernetesSpec(namespace=OTHER_NAMESPACE)
    with pytest.raises(KubeError, match=f"namespace {OTHER_NAMESPACE} is not one this replica watches"):
        await stage.backend.allocate(AllocationRequest(job_id=unique("job"), workers=1, spares=0, section=elsewhere))
