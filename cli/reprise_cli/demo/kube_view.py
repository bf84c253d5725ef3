"""What the Kubernetes API server shows of the demo's nodes, read back as its admin: after an XID 79's recovery the
node is unschedulable, with Reprise's `NoSchedule` taint and the incident in its annotation (what `kubectl describe
node` would show a person), and a lost node NotReady."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from reprise_cli.kube_cluster import KubeCluster
from reprise_common.clock import utcnow

TAINT_KEY = "reprise.dev/cordoned"  # the orchestrator's (compute/kubernetes/cordon.py), read here as a user would
INCIDENT_ANNOTATION = "reprise.dev/incident"


@dataclass(frozen=True)
class NodeSighting:
    """What the API server has of one node."""

    node: str
    unschedulable: bool
    taints: list[tuple[str, str, str]]  # (key, value, effect)
    incident: str  # Reprise's incident annotation ("" when none)
    ready: str  # the Ready condition's status ("True", "False", "Unknown", "" when none)
    at: datetime

    @classmethod
    def of(cls, node: dict[str, Any]) -> NodeSighting:
        """The node as read (JSON)."""
        spec, meta = node.get("spec", {}), node.get("metadata", {})
        conditions = node.get("status", {}).get("conditions", [])
        return cls(
            node=meta.get("name", ""),
            unschedulable=bool(spec.get("unschedulable")),
            taints=[(t["key"], t.get("value", ""), t["effect"]) for t in spec.get("taints", [])],
            incident=(meta.get("annotations") or {}).get(INCIDENT_ANNOTATION, ""),
            ready=next((c["status"] for c in conditions if c["type"] == "Ready"), ""),
            at=utcnow(),
        )

    def cordoned_for(self, incident_id: str) -> bool:
        """Unschedulable, with Reprise's taint for the incident and the incident in the annotation."""
        ours = [t for t in self.taints if t[0] == TAINT_KEY]
        return self.unschedulable and self.incident == incident_id and ours == [(TAINT_KEY, incident_id, "NoSchedule")]

    def describe(self) -> str:
        """One line, as a person would read the node."""
        taints = ", ".join(f"{key}={value}:{effect}" for key, value, effect in self.taints) or "none"
        incident = f"{INCIDENT_ANNOTATION}={self.incident or 'none'}"
        return f"unschedulable={self.unschedulable}, taints {taints}, {incident}, Ready={self.ready}"


class KubeView:
    """Reads the demo's nodes from the API server."""

    def __init__(self, cluster: KubeCluster) -> None:
        self.cluster = cluster

    def node(self, name: str) -> NodeSighting:
        """The node now."""
        return NodeSighting.of(self.cluster.read_node(name))

    def wait_for(self, name: str, matches: Any, *, timeout_s: float) -> NodeSighting:
        """The node once `matches(sighting)`, or as last read after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        seen = self.node(name)
        while not matches(seen) and time.monotonic() < deadline:
            time.sleep(0.1)
            seen = self.node(name)
        return seen
