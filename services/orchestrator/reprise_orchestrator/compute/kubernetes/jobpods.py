"""A job's allocation on Kubernetes: one pod per node, each running that node's agent (pods.py).

Kubernetes has no allocation to ask for, so the backend makes it: `allocate` chooses the job's nodes among the
labelled nodes Kubernetes would schedule on (Ready, not cordoned, untainted, matching the job's node selector) that
hold no other job's live pod, and binds one pod to each by `nodeName`; the first `workers` are the job's workers, the
rest its spares. The allocation is the job's pods as the pod watches see them: running while any of them lives, ended
once none does. `requeue` replaces the pods on excluded, unschedulable or failed nodes by spares on free nodes, and
`cancel` deletes every pod of the job; pods Reprise deletes are released first, so they are not signalled.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Set
from dataclasses import dataclass

from kubernetes.aio.client import V1Node

from reprise_common.logging import get_logger
from reprise_orchestrator.compute.allocation import AgentLaunch, Allocation, AllocationRequest, AllocationState
from reprise_orchestrator.compute.backend import SignalSink
from reprise_orchestrator.compute.kubernetes.api import (
    KubeApi,
    KubeConflictError,
    KubeError,
    KubeNotFoundError,
    KubeUnavailableError,
)
from reprise_orchestrator.compute.kubernetes.models import KubernetesSpec
from reprise_orchestrator.compute.kubernetes.nodes import NodeWatch, schedulable
from reprise_orchestrator.compute.kubernetes.pods import JOB_LABEL, RELEASED, PodTemplate, PodView, agent_pod, view
from reprise_orchestrator.compute.kubernetes.podwatch import PodWatch

log = get_logger("reprise.orchestrator.compute.kubernetes")


@dataclass(frozen=True)
class PodSettings:
    """The operator's settings of the jobs' pods: how agents start, the image, the namespaces (the first is the
    default), and the defaults a job's `kubernetes` section may override."""

    launch: AgentLaunch | None
    image: str
    namespaces: tuple[str, ...]
    service_account: str | None = None
    seeds_secret: str | None = None


class JobPods:
    """The jobs' pods in the operator's namespaces (a pod watch for each), and the allocations they make."""

    def __init__(
        self,
        api: KubeApi,
        settings: PodSettings,
        *,
        nodes: NodeWatch,
        backend: str,
        watch_timeout_s: int,
        retry_s: float,
    ) -> None:
        self.api = api
        self.settings = settings
        self.nodes = nodes
        self.watches = {
            namespace: PodWatch(api, namespace, backend=backend, watch_timeout_s=watch_timeout_s, retry_s=retry_s)
            for namespace in settings.namespaces
        }

    async def run(self, emit: SignalSink) -> None:
        """Watch every namespace's pods until cancelled."""
        await asyncio.gather(*(watch.run(emit) for watch in self.watches.values()))

    def template(self, placement: KubernetesSpec | None) -> PodTemplate:
        """The pods' template for a job's section (None: the operator's defaults)."""
        if self.settings.launch is None:
            raise KubeError(
                "this replica has no agent launch configured: it creates no pods", verb="create", resource="pods"
            )
        section = placement or KubernetesSpec()
        namespace = section.namespace or self.settings.namespaces[0]
        if namespace not in self.watches:
            raise KubeError(
                f"namespace {namespace} is not one this replica watches (REPRISE_KUBERNETES_NAMESPACES)",
                verb="create",
                resource="pods",
                namespace=namespace,
            )
        return PodTemplate(
            namespace=namespace,
            image=self.settings.image,
            launch=self.settings.launch,
            node_selector=dict(section.node_selector),
            service_account=section.service_account or self.settings.service_account,
            seeds_secret=self.settings.seeds_secret,
        )

    def all_pods(self) -> list[PodView]:
        """Every job's pods as last seen; KubeUnavailableError before every watch has listed."""
        self._listed()
        return [pod for watch in self.watches.values() for pod in watch.pods()]

    def of_job(self, job_id: str) -> list[PodView]:
        """The job's pods as last seen, in index order."""
        return sorted((pod for pod in self.all_pods() if pod.job_id == job_id), key=lambda pod: pod.index)

    def nodes_of(self, job_id: str) -> set[str]:
        """The nodes of the job's live pods."""
        return {pod.node for pod in self.of_job(job_id) if pod.live and pod.node}

    def free_nodes(self, node_selector: dict[str, str], *, exclude: Set[str] = frozenset()) -> list[str]:
        """The labelled nodes Kubernetes would schedule on that match the selector and hold no job's live pod."""
        return self._free(node_selector, {pod.node for pod in self.all_pods() if pod.live} | exclude)

    def _free(self, node_selector: dict[str, str], unavailable: Set[str]) -> list[str]:
        return sorted(
            name
            for name, node in self.nodes.nodes.items()
            if schedulable(node) and name not in unavailable and _matches(node, node_selector)
        )

    async def allocate(self, request: AllocationRequest, placement: KubernetesSpec | None = None) -> str:
        """Bind one pod per node of the request to free nodes (workers first); the job's namespace and id as the
        allocation's id. A job that has pods already keeps them (a repeated submission)."""
        template = self.template(placement)
        if any(pod.live for pod in self.of_job(request.job_id)):
            return _allocation_id(template.namespace, request.job_id)
        free = self.free_nodes(template.node_selector)
        if len(free) < request.nodes:
            raise KubeError(
                f"job {request.job_id} needs {request.nodes} nodes; {len(free)} labelled, schedulable and free nodes "
                f"match its node selector {template.node_selector or '{}'}",
                verb="create",
                resource="pods",
                namespace=template.namespace,
            )
        for index, node in enumerate(free[: request.nodes]):
            await self._create(
                template, request.job_id, index, node, size=request.nodes, spare=index >= request.workers
            )
        log.info("Kubernetes pods created", extra={"job_id": request.job_id, "nodes": free[: request.nodes]})
        return _allocation_id(template.namespace, request.job_id)

    def allocations(self) -> dict[str, Allocation]:
        """Each job's allocation as its pods show it."""
        jobs = {pod.job_id for pod in self.all_pods() if pod.job_id is not None}
        return {job_id: self._allocation(job_id) for job_id in jobs}

    async def requeue(self, job_id: str, *, exclude: Set[str] = frozenset()) -> list[str] | None:
        """Replace the job's pods on nodes in `exclude`, unschedulable or whose pod ended by spares on free nodes, up
        to the allocation's size (as many as are free); the nodes left out, or None when nothing was done. Read from
        the API server, not the watches: a view a moment stale would replace a pod twice."""
        pods = await self._read()
        mine = sorted((pod for pod in pods if pod.job_id == job_id), key=lambda pod: pod.index)
        if not mine:
            return None
        bad = [p for p in mine if not p.deleting and (p.ended or p.node in exclude or not self._usable(p))]
        good = [pod for pod in mine if pod.live and pod not in bad]
        busy = {pod.node for pod in pods if pod.live and pod not in bad}
        template = _template_of(mine[0], self.template(None))
        size = mine[0].size or len(mine)
        left_out = sorted({pod.node for pod in bad if pod.node})  # not taken again: what failed there may again
        free = self._free(template.node_selector, busy | exclude | set(left_out))[: max(size - len(good), 0)]
        if not bad and not free:
            return None
        for pod in bad:
            await self._delete(pod)
        start = max(pod.index for pod in mine) + 1
        for offset, node in enumerate(free):
            await self._create(template, job_id, start + offset, node, size=size, spare=True)
        log.warning("Kubernetes pods replaced", extra={"job_id": job_id, "left_out": left_out, "new": free})
        return left_out

    async def cancel(self, job_id: str) -> list[int]:
        """Delete every pod of the job (released: no signal); the indexes of the pods deleted."""
        pods = [pod for pod in self.of_job(job_id) if not pod.deleting]
        for pod in pods:
            await self._delete(pod)
        if pods:
            log.info("Kubernetes pods deleted", extra={"job_id": job_id, "pods": len(pods)})
        return [pod.index for pod in pods]

    def _allocation(self, job_id: str) -> Allocation:
        pods = self.of_job(job_id)
        running = [pod for pod in pods if pod.live]
        state = AllocationState.RUNNING if running else AllocationState.ENDED
        if running and any(not pod.node for pod in running):
            state = AllocationState.WAITING
        nodes = tuple(pod.node for pod in running) if state is AllocationState.RUNNING else ()
        detail = f"{len(running)} of {len(pods)} pods of job {job_id} live"
        return Allocation(
            job_id=job_id,
            scheduler_id=_allocation_id(pods[0].namespace, job_id),
            state=state,
            nodes=nodes,
            detail=detail,
        )

    def _usable(self, pod: PodView) -> bool:
        node = self.nodes.nodes.get(pod.node)
        return node is not None and schedulable(node)

    async def _create(
        self, template: PodTemplate, job_id: str, index: int, node: str, *, size: int, spare: bool
    ) -> None:
        pod = agent_pod(template, job_id=job_id, index=index, size=size, node=node, spare=spare)
        try:
            await self.api.create_pod(template.namespace, pod)
        except KubeConflictError:  # created already (a repeated allocation, or another replica's)
            log.info("Kubernetes pod exists already", extra={"job_id": job_id, "index": index})

    async def _delete(self, pod: PodView) -> None:
        """Mark the pod released (so no replica's watch takes its end for a fault), then delete it."""
        self.watches[pod.namespace].released.add(pod.name)
        with contextlib.suppress(KubeNotFoundError):  # gone already
            await self.api.annotate_pod(pod.namespace, pod.name, {RELEASED: "true"})
            await self.api.delete_pod(pod.namespace, pod.name)

    async def _read(self) -> list[PodView]:
        """Every job's pods as the API server has them now."""
        found: list[PodView] = []
        for namespace in self.watches:
            listed = await self.api.list_pods(namespace, label_selector=JOB_LABEL)
            found.extend(view(pod) for pod in listed.items)
        return found

    def _listed(self) -> None:
        if self.nodes.resource_version is None or any(w.resource_version is None for w in self.watches.values()):
            raise KubeUnavailableError(
                "Kubernetes' nodes and pods are not read yet (the backend's watches have not listed them)",
                verb="list",
                resource="pods",
            )


def _matches(node: V1Node, selector: dict[str, str]) -> bool:
    labels = (node.metadata.labels if node.metadata is not None else None) or {}
    return all(labels.get(key) == value for key, value in selector.items())


def _allocation_id(namespace: str, job_id: str) -> str:
    return f"{namespace}/{job_id}"


def _template_of(pod: PodView, defaults: PodTemplate) -> PodTemplate:
    """The template a job's pods were made with (its namespace, node selector and service account)."""
    return PodTemplate(
        namespace=pod.namespace,
        image=defaults.image,
        launch=defaults.launch,
        node_selector=pod.node_selector,
        service_account=pod.service_account,
        seeds_secret=defaults.seeds_secret,
    )
