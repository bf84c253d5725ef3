"""Kubernetes' own failure signals from Node conditions: what changed between two states of a node, as ComputeSignals.

A pure function of two states, so the watch reports each transition once, and a watch that resumes after a 410
(relisting every node) compares against the last state it saw and reports only what changed meanwhile. A node seen
for the first time is a baseline (a node that registers is NotReady until its kubelet says otherwise). Each signal's
event id is built from the transition (the node, the condition, its lastTransitionTime), so replicas that see it
publish it under one message id and the COMPUTE stream keeps it once.
"""

from __future__ import annotations

from dataclasses import dataclass

from kubernetes.aio.client import V1Node

from reprise_common.events import ComputeSignal, ComputeSignalKind
from reprise_orchestrator.compute.backend import compute_signal


@dataclass(frozen=True)
class Condition:
    """One Node condition as the kubelet (or the node controller) last wrote it."""

    status: str  # "True", "False" or "Unknown"
    reason: str = ""
    message: str = ""
    since: str = ""  # lastTransitionTime, ISO 8601


@dataclass(frozen=True)
class NodeHealth:
    """The conditions of one node that say it cannot run ranks, by type (Ready, NetworkUnavailable)."""

    conditions: dict[str, Condition]

    def status(self, kind: str) -> str:
        """A condition's status, "" when the node does not report it."""
        found = self.conditions.get(kind)
        return found.status if found is not None else ""


def health(node: V1Node) -> NodeHealth:
    """The conditions of a node as read from the API server."""
    found: dict[str, Condition] = {}
    for condition in (node.status.conditions or []) if node.status is not None else []:
        since = condition.last_transition_time.isoformat() if condition.last_transition_time else ""
        found[condition.type] = Condition(
            status=condition.status, reason=condition.reason or "", message=condition.message or "", since=since
        )
    return NodeHealth(conditions=found)


# (condition type, the status that is a fault, the signal's kind)
_FAULTS = (
    ("Ready", "False", ComputeSignalKind.NODE_DOWN),  # the kubelet says the node is not ready
    ("Ready", "Unknown", ComputeSignalKind.NODE_NOT_RESPONDING),  # the kubelet stopped posting its status
    ("NetworkUnavailable", "True", ComputeSignalKind.NODE_DOWN),
)


def node_signals(name: str, before: NodeHealth | None, after: NodeHealth, *, backend: str) -> list[ComputeSignal]:
    """The signals of the conditions that became faults from `before` to `after` (none for a node first seen)."""
    if before is None:
        return []
    found: list[ComputeSignal] = []
    for kind, bad, signal_kind in _FAULTS:
        if after.status(kind) == bad and before.status(kind) != bad:
            condition = after.conditions[kind]
            detail = f"Kubernetes shows node {name} {kind}={bad}"
            if condition.reason or condition.message:
                detail += f": {condition.reason} {condition.message}".rstrip()
            found.append(
                compute_signal(backend, signal_kind, (name, kind, bad, condition.since), node_id=name, detail=detail)
            )
    return found
