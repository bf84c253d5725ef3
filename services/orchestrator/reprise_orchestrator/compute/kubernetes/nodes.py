"""The nodes as the API server has them, kept current by a list and a watch (watch.py), and their failure signals.

The first list is the baseline; each later change that makes a condition a fault is signalled once (signals.py),
including one made while the watch was away (a 410 lists again and compares against the last state seen).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from kubernetes.aio.client import V1Node

from reprise_common.logging import get_logger
from reprise_orchestrator.compute.backend import SignalSink
from reprise_orchestrator.compute.kubernetes.api import KubeApi, WatchEvent
from reprise_orchestrator.compute.kubernetes.cordon import cordoned_by_us
from reprise_orchestrator.compute.kubernetes.signals import NodeHealth, health, node_signals
from reprise_orchestrator.compute.kubernetes.watch import ListWatch

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


class NodeWatch(ListWatch):
    """The labelled nodes as last seen (by name), their health, and the version the watch goes on from."""

    resource = "nodes"

    def __init__(
        self,
        api: KubeApi,
        *,
        backend: str,
        label_selector: str | None = None,
        watch_timeout_s: int = 60,
        retry_s: float = 1.0,
    ) -> None:
        super().__init__(watch_timeout_s=watch_timeout_s, retry_s=retry_s)
        self.api = api
        self.backend = backend
        self.label_selector = label_selector
        self.health: dict[str, NodeHealth] = {}

    @property
    def nodes(self) -> dict[str, V1Node]:
        """The labelled nodes as last seen, by name."""
        return self.objects

    async def list(self) -> tuple[list[Any], str | None]:
        """Every labelled node, and the list's resourceVersion."""
        found = await self.api.list_nodes(label_selector=self.label_selector)
        return list(found.items), found.metadata.resource_version if found.metadata is not None else None

    def stream(self, resource_version: str) -> AsyncIterator[WatchEvent]:
        """The changes to the labelled nodes after `resource_version`."""
        return self.api.watch_nodes(
            resource_version=resource_version, label_selector=self.label_selector, timeout_s=self.watch_timeout_s
        )

    async def seen(self, name: str, before: Any | None, after: Any, emit: SignalSink) -> None:
        """Signal each condition that became a fault (none for a node first seen: a baseline)."""
        now = health(after)
        for signal in node_signals(name, self.health.get(name), now, backend=self.backend):
            log.warning("Kubernetes node fault", extra={"node_id": name, "kind": signal.kind.value})
            await emit(signal)
        self.health[name] = now

    async def gone(self, name: str, before: Any, emit: SignalSink) -> None:
        """A node removed from the cluster (or its label): forgotten, no signal (its agent's silence tells)."""
        self.health.pop(name, None)
