"""The nodes as the API server has them, kept current by a list and a watch, and their failure signals.

The first list is the baseline; a watch then goes on from the list's resourceVersion, and each change that makes a
condition a fault is signalled once (signals.py). A watch the server ends (its timeout) goes on from the last version
seen; one whose version is older than the server keeps (410 Gone: etcd compacted it) lists every node again and
compares against the last state it saw, so a change made while it was away is signalled once, none twice, none lost.
"""

from __future__ import annotations

import asyncio

from kubernetes.aio.client import V1Node

from reprise_common.logging import get_logger
from reprise_orchestrator.compute.backend import SignalSink
from reprise_orchestrator.compute.kubernetes.api import (
    KubeApi,
    KubeError,
    KubeExpiredError,
    KubeUnavailableError,
    NodeEvent,
)
from reprise_orchestrator.compute.kubernetes.cordon import cordoned_by_us
from reprise_orchestrator.compute.kubernetes.signals import NodeHealth, health, node_signals

log = get_logger("reprise.orchestrator.compute.kubernetes")
_BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")


def schedulable(node: V1Node) -> bool:
    """Ready, not cordoned, and with no taint that keeps new pods off (ours or anyone's)."""
    spec, status = node.spec, node.status
    if spec is not None and spec.unschedulable:
        return False
    if spec is not None and any(taint.effect in _BLOCKING_EFFECTS for taint in spec.taints or []):
        return False
    ready = [c for c in (status.conditions or []) if c.type == "Ready"] if status is not None else []
    return bool(ready) and ready[0].status == "True" and not cordoned_by_us(node)


class NodeWatch:
    """The labelled nodes as last seen (by name), their health, and the version the watch goes on from."""

    def __init__(
        self,
        api: KubeApi,
        *,
        backend: str,
        label_selector: str | None = None,
        watch_timeout_s: int = 60,
        retry_s: float = 1.0,
    ) -> None:
        self.api = api
        self.backend = backend
        self.label_selector = label_selector
        self.watch_timeout_s = watch_timeout_s
        self.retry_s = retry_s
        self.nodes: dict[str, V1Node] = {}
        self.health: dict[str, NodeHealth] = {}
        self.resource_version: str | None = None  # None until the first list
        self.lists = 0  # how many lists were taken: the first, and one after each expired watch

    async def run(self, emit: SignalSink) -> None:
        """List and watch until cancelled; a server that does not answer is tried again after `retry_s`, one that
        refuses (403: the identity lacks `watch` on nodes) after ten times that, each logged."""
        while True:
            try:
                await self.watch_once(emit)
            except KubeUnavailableError as exc:
                log.warning("Kubernetes nodes not watched", extra={"error": str(exc)})
                await asyncio.sleep(self.retry_s)
            except KubeError as exc:  # forbidden, or refused: a person must act; tried again, less often
                log.error("Kubernetes nodes not watched: refused", extra={"error": str(exc)})
                await asyncio.sleep(self.retry_s * 10)

    async def watch_once(self, emit: SignalSink) -> None:
        """One watch, until the server ends it (after listing first when there is no version to go on from)."""
        if self.resource_version is None:
            await self.relist(emit)
        assert self.resource_version is not None
        try:
            async for event in self.api.watch_nodes(
                resource_version=self.resource_version,
                label_selector=self.label_selector,
                timeout_s=self.watch_timeout_s,
            ):
                await self._apply(event, emit)
        except KubeExpiredError as exc:
            log.info("Kubernetes node watch expired: listing again", extra={"error": str(exc)})
            await self.relist(emit)

    async def relist(self, emit: SignalSink) -> None:
        """List every labelled node; what changed since the last state seen is signalled (nothing on the first)."""
        found = await self.api.list_nodes(label_selector=self.label_selector)
        self.lists += 1
        listed = {node.metadata.name: node for node in found.items if node.metadata and node.metadata.name}
        for name in set(self.nodes) - set(listed):
            self._forget(name)
        for name, node in listed.items():
            await self._seen(name, node, emit)
        version = found.metadata.resource_version if found.metadata is not None else None
        if not version:
            raise KubeError("a node list came without a resourceVersion", verb="list", resource="nodes")
        self.resource_version = version

    async def _apply(self, event: NodeEvent, emit: SignalSink) -> None:
        node = event.node
        if node is not None and node.metadata is not None and node.metadata.name:
            if event.type == "DELETED":
                self._forget(node.metadata.name)
            elif event.type in ("ADDED", "MODIFIED"):
                await self._seen(node.metadata.name, node, emit)
        if event.resource_version:
            self.resource_version = event.resource_version

    async def _seen(self, name: str, node: V1Node, emit: SignalSink) -> None:
        after = health(node)
        for signal in node_signals(name, self.health.get(name), after, backend=self.backend):
            log.warning("Kubernetes node fault", extra={"node_id": name, "kind": signal.kind.value})
            await emit(signal)
        self.nodes[name] = node
        self.health[name] = after

    def _forget(self, name: str) -> None:
        self.nodes.pop(name, None)
        self.health.pop(name, None)
