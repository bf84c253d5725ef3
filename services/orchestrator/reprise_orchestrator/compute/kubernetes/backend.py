"""The kubernetes compute backend: Reprise's agents run the ranks, Kubernetes owns the nodes.

Launch and stop go to the agents, exactly as on the built-in backend (each agent runs in a pod on its node, so rank
supervision, GPU health and every detection path stay the same; agents' node ids are the Kubernetes node names).
What Kubernetes owns goes to the API server through the one adapter (api.py): a cordon sets `spec.unschedulable` and
Reprise's `NoSchedule` taint with the incident in an annotation, an uncordon lifts only what Reprise added (an admin's
own cordon stays), nodes Kubernetes would not schedule on are never offered, and Node conditions that become faults
are reported by the watch (nodes.py). Every write carries the resourceVersion it was computed from; a 409 (the node
changed meanwhile) reads the node again and recomputes, a few times at most; a cordon the server does not take (it
is away, or refuses for a moment after a restart) stays owed and the watch applies it later.

The job's nodes are its pods (jobpods.py): the backend is an `AllocatingBackend` (compute/allocation.py) whose
allocation binds one pod per node, each running that node's agent; the job's pods that fail, are evicted, preempted,
OOM-killed or deleted by someone else are signalled once each (podwatch.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Set
from typing import Any

from kubernetes.aio.client import V1Node

from reprise_common.logging import get_logger
from reprise_orchestrator.compute.agents.backend import AgentsBackend
from reprise_orchestrator.compute.agents.delegate import AgentsDelegate
from reprise_orchestrator.compute.allocation import Allocation, AllocationRequest
from reprise_orchestrator.compute.backend import NodePool, SignalSink
from reprise_orchestrator.compute.kubernetes.api import (
    KubeApi,
    KubeConflictError,
    KubeError,
    KubeNotFoundError,
    KubeUnavailableError,
)
from reprise_orchestrator.compute.kubernetes.cordon import cordon_patch, uncordon_patch
from reprise_orchestrator.compute.kubernetes.jobpods import JobPods, PodSettings
from reprise_orchestrator.compute.kubernetes.models import KubernetesSpec
from reprise_orchestrator.compute.kubernetes.nodes import NodeWatch, schedulable

log = get_logger("reprise.orchestrator.compute.kubernetes")
Patcher = Callable[[V1Node], dict[str, Any] | None]


class KubernetesBackend(AgentsDelegate):
    """Ranks through the agents in their pods; cordons, usable nodes and node signals through the API server."""

    name = "kubernetes"

    def __init__(
        self,
        *,
        agents: AgentsBackend,
        api: KubeApi,
        label_selector: str | None = None,
        pods: PodSettings | None = None,
        write_attempts: int = 5,
        watch_timeout_s: int = 60,
        retry_s: float = 1.0,
    ) -> None:
        self.agents = agents
        self.api = api
        self.write_attempts = write_attempts
        self.retry_s = retry_s
        self._owed: dict[str, str | None] = {}  # node → a cordon's reason, or None for an uncordon, not yet taken
        self.nodes = NodeWatch(
            api, backend=self.name, label_selector=label_selector, watch_timeout_s=watch_timeout_s, retry_s=retry_s
        )
        settings = pods or PodSettings(launch=None, image="", namespaces=())
        self.pods = JobPods(
            api, settings, nodes=self.nodes, backend=self.name, watch_timeout_s=watch_timeout_s, retry_s=retry_s
        )

    def pool(self, *, exclude: Set[str] = frozenset(), job_id: str | None = None) -> NodePool:
        """The agents' usable nodes that Kubernetes would schedule on now (labelled, Ready, not cordoned, untainted);
        KubeUnavailableError before the watch has listed the nodes."""
        if self.nodes.resource_version is None:
            raise KubeUnavailableError(
                "Kubernetes' nodes are not read yet (the backend's watch has not listed them)",
                verb="list",
                resource="nodes",
            )
        offered = self.agents.pool(exclude=exclude)
        usable = {name for name, node in self.nodes.nodes.items() if schedulable(node)}
        if job_id is not None:  # only the nodes of the job's own live pods: another job's run another job's agents
            usable &= self.pods.nodes_of(job_id)
        return NodePool(
            workers=[name for name in offered.workers if name in usable],
            spares=[name for name in offered.spares if name in usable],
        )

    async def cordon(self, node_id: str, *, reason: str) -> None:
        """Mark the node unschedulable with Reprise's taint and the reason (and incident) in annotations.

        Any error but KubeNotFoundError (the API server does not answer, or refuses: a 403 comes also for a moment
        after it restarts, before its RBAC caches are filled) leaves the cordon owed, and the watch applies it once
        the server takes it (the orchestrator has recorded its own cordon, and will not ask twice).
        """
        await self._change(node_id, reason)

    async def uncordon(self, node_id: str) -> None:
        """Lift Reprise's cordon; a node an admin had cordoned stays unschedulable (owed as a cordon is)."""
        await self._change(node_id, None)

    async def allocate(self, request: AllocationRequest) -> str:
        """Bind one agent pod per node of the request to free labelled nodes (where its section, the job's
        `kubernetes` section, says; the operator's defaults otherwise); the allocation's id (`<namespace>/<job>`)."""
        placement = request.section if isinstance(request.section, KubernetesSpec) else None
        return await self.pods.allocate(request, placement)

    async def allocations(self) -> dict[str, Allocation]:
        """Each job's allocation as the pod watches last saw its pods."""
        return self.pods.allocations()

    async def requeue(self, job_id: str, *, exclude: Set[str] = frozenset()) -> list[str] | None:
        """Replace the job's pods on excluded, unschedulable or failed nodes by spares on free nodes."""
        return await self.pods.requeue(job_id, exclude=exclude)

    async def cancel(self, job_id: str) -> list[int]:
        """Delete the job's pods (no signal for them)."""
        return await self.pods.cancel(job_id)

    async def watch(self, emit: SignalSink) -> None:
        """Watch the labelled nodes and the jobs' pods until cancelled, emitting each fault once, and apply the
        cordons and uncordons the API server did not take when asked."""
        await asyncio.gather(self.nodes.run(emit), self.pods.run(emit), self._settle_owed())

    async def _change(self, node_id: str, reason: str | None) -> None:
        """Cordon (for `reason`) or uncordon (None) the node; owed while the API server does not answer."""
        self._owed[node_id] = reason
        try:
            await self._write(node_id, uncordon_patch if reason is None else lambda node: cordon_patch(node, reason))
        except KubeNotFoundError:
            self._settled(node_id, reason)  # no such node: retrying cannot help
            raise
        self._settled(node_id, reason)
        log.info("node cordon changed in Kubernetes", extra={"node_id": node_id, "cordon": reason})

    def _settled(self, node_id: str, reason: str | None) -> None:
        if node_id in self._owed and self._owed[node_id] == reason:  # a newer change meanwhile stays owed
            del self._owed[node_id]

    async def _settle_owed(self) -> None:
        """Every `retry_s`, apply what is owed; an unknown node is dropped, any other refusal tried again."""
        while True:
            await asyncio.sleep(self.retry_s)
            for node_id, reason in list(self._owed.items()):
                try:
                    await self._change(node_id, reason)
                except KubeUnavailableError:
                    break  # still away: the next round
                except KubeError as exc:
                    log.warning("owed Kubernetes cordon not taken", extra={"node_id": node_id, "error": str(exc)})

    async def close(self) -> None:
        """Close the API server's connections and the agents' backend."""
        await self.api.close()
        await self.agents.close()

    async def _write(self, node_id: str, patch_for: Patcher) -> V1Node:
        """Read the node, patch it with the change computed from what was read (under its resourceVersion); on a
        conflict read again and recompute. Nothing is written when nothing would change."""
        for attempt in range(1, self.write_attempts + 1):
            node = await self.api.get_node(node_id)
            patch = patch_for(node)
            if patch is None:
                return node
            try:
                return await self.api.patch_node(node_id, patch)
            except KubeConflictError as exc:
                if attempt == self.write_attempts:
                    raise
                log.info("node changed since read: reading again", extra={"node_id": node_id, "error": str(exc)})
        raise AssertionError("unreachable: the last attempt returns or raises")
