"""The kubernetes compute backend: Reprise's agents run the ranks, Kubernetes owns the nodes.

Launch and stop go to the agents, exactly as on the built-in backend (each agent runs in a pod on its node, so rank
supervision, GPU health and every detection path stay the same; agents' node ids are the Kubernetes node names).
What Kubernetes owns goes to the API server through the one adapter (api.py): a cordon sets `spec.unschedulable` and
Reprise's `NoSchedule` taint with the incident in an annotation, an uncordon lifts only what Reprise added (an admin's
own cordon stays), nodes Kubernetes would not schedule on are never offered, and Node conditions that become faults
are reported by the watch (nodes.py). Every write carries the resourceVersion it was computed from; a 409 (the node
changed meanwhile) reads the node again and recomputes, a few times at most.

Not yet here (issue 43): creating the job's pods (its allocation), signals from the job's pods (evicted, preempted,
OOM-killed, deleted by someone else), and the built-in `kubernetes` choice in compute/choose.py.
"""

from __future__ import annotations

from collections.abc import Callable, Set
from typing import Any

from kubernetes.aio.client import V1Node

from reprise_common.logging import get_logger
from reprise_orchestrator.compute.agents.backend import AgentsBackend
from reprise_orchestrator.compute.agents.delegate import AgentsDelegate
from reprise_orchestrator.compute.backend import NodePool, SignalSink
from reprise_orchestrator.compute.kubernetes.api import KubeApi, KubeConflictError, KubeUnavailableError
from reprise_orchestrator.compute.kubernetes.cordon import cordon_patch, uncordon_patch
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
        write_attempts: int = 5,
        watch_timeout_s: int = 60,
        retry_s: float = 1.0,
    ) -> None:
        self.agents = agents
        self.api = api
        self.write_attempts = write_attempts
        self.nodes = NodeWatch(
            api, backend=self.name, label_selector=label_selector, watch_timeout_s=watch_timeout_s, retry_s=retry_s
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
        offered = self.agents.pool(exclude=exclude, job_id=job_id)
        usable = {name for name, node in self.nodes.nodes.items() if schedulable(node)}
        return NodePool(
            workers=[name for name in offered.workers if name in usable],
            spares=[name for name in offered.spares if name in usable],
        )

    async def cordon(self, node_id: str, *, reason: str) -> None:
        """Mark the node unschedulable with Reprise's taint and the reason (and incident) in annotations."""
        await self._write(node_id, lambda node: cordon_patch(node, reason))
        log.info("node cordoned in Kubernetes", extra={"node_id": node_id, "reason": reason})

    async def uncordon(self, node_id: str) -> None:
        """Lift Reprise's cordon; a node an admin had cordoned stays unschedulable."""
        await self._write(node_id, uncordon_patch)
        log.info("node uncordoned in Kubernetes", extra={"node_id": node_id})

    async def watch(self, emit: SignalSink) -> None:
        """Watch the labelled nodes until cancelled, emitting each condition that became a fault once."""
        await self.nodes.run(emit)

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
