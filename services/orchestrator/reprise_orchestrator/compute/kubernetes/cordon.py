"""What a cordon and an uncordon change on a Node: the patches, computed from the node as last read.

Reprise's cordon is `spec.unschedulable: true` (what `kubectl cordon` sets) plus a `NoSchedule` taint of its own,
`reprise.dev/cordoned=<incident>`, with the reason and the incident in annotations, so that both Kubernetes' scheduler
and a person reading the node see who cordoned it and why. A node an admin had cordoned already keeps the admin's
cordon: that is recorded in an annotation at cordon time, and uncordon then lifts only what Reprise added, as the
Slurm backend never resumes an admin's drain. Each patch carries the node's resourceVersion, so a node changed since it
was read is refused by the server (409) and read again, never overwritten (taints are a list: a merge patch replaces
it whole, and a stale one would drop a taint someone added meanwhile).
"""

from __future__ import annotations

import json
import re
from typing import Any

from kubernetes.aio.client import V1Node, V1Taint

TAINT_KEY = "reprise.dev/cordoned"
TAINT_EFFECT = "NoSchedule"
REASON_ANNOTATION = "reprise.dev/cordon-reason"
INCIDENT_ANNOTATION = "reprise.dev/incident"
# "true" when the node was already unschedulable (an admin's cordon) when Reprise cordoned it: uncordon leaves it so
KEPT_ANNOTATION = "reprise.dev/admin-cordon-kept"
_ANNOTATIONS = (REASON_ANNOTATION, INCIDENT_ANNOTATION, KEPT_ANNOTATION)
_INCIDENT = re.compile(r"^incident ([^\s:]+):")
_LABEL_VALUE_BAD = re.compile(r"[^A-Za-z0-9_.-]+")
_REASON_MAX = 1024


def incident_of(reason: str) -> str | None:
    """The incident id a recovery's reason names (`incident <id>: ...`), or None for an operator's cordon."""
    found = _INCIDENT.match(reason)
    return found.group(1) if found else None


def taint_value(reason: str) -> str:
    """The taint's value: the incident id (or `operator`), made a valid label value (63 characters at most)."""
    value = _LABEL_VALUE_BAD.sub("-", incident_of(reason) or "operator")[:63].strip("-_.")
    return value or "operator"


def _taints(node: V1Node) -> list[dict[str, Any]]:
    taints: list[V1Taint] = list(node.spec.taints or []) if node.spec is not None else []
    return [json.loads(taint.to_json()) for taint in taints]


def _annotations(node: V1Node) -> dict[str, str]:
    return dict(node.metadata.annotations or {}) if node.metadata is not None else {}


def _unschedulable(node: V1Node) -> bool:
    return bool(node.spec is not None and node.spec.unschedulable)


def cordoned_by_us(node: V1Node) -> bool:
    """True when the node carries Reprise's cordon taint."""
    return any(taint["key"] == TAINT_KEY for taint in _taints(node))


def admin_cordoned(node: V1Node) -> bool:
    """True when the node is unschedulable by someone else's cordon (Reprise's own may be there too)."""
    if not _unschedulable(node):
        return False
    return not cordoned_by_us(node) or _annotations(node).get(KEPT_ANNOTATION) == "true"


def _resource_version(node: V1Node) -> str:
    version = node.metadata.resource_version if node.metadata is not None else None
    if not version:
        raise ValueError("a node read from the API server always has a resourceVersion")
    return str(version)


def cordon_patch(node: V1Node, reason: str) -> dict[str, Any] | None:
    """The merge patch that cordons the node for `reason`, or None when it is cordoned so already."""
    text = " ".join(reason.split())[:_REASON_MAX] or "cordoned"
    incident = incident_of(text) or ""
    annotations = _annotations(node)
    kept = "true" if admin_cordoned(node) else "false"
    ours = {"key": TAINT_KEY, "value": taint_value(text), "effect": TAINT_EFFECT}
    others = [taint for taint in _taints(node) if taint["key"] != TAINT_KEY]
    current = [taint for taint in _taints(node) if taint["key"] == TAINT_KEY]
    wanted = {REASON_ANNOTATION: text, INCIDENT_ANNOTATION: incident, KEPT_ANNOTATION: kept}
    same_taint = len(current) == 1 and all(current[0].get(k) == v for k, v in ours.items())
    if _unschedulable(node) and same_taint and all(annotations.get(k) == v for k, v in wanted.items()):
        return None
    return {
        "metadata": {"resourceVersion": _resource_version(node), "annotations": wanted},
        "spec": {"unschedulable": True, "taints": [*others, ours]},
    }


def uncordon_patch(node: V1Node) -> dict[str, Any] | None:
    """The merge patch that lifts Reprise's cordon (leaving an admin's), or None when there is none of ours."""
    annotations = _annotations(node)
    if not cordoned_by_us(node) and not any(key in annotations for key in _ANNOTATIONS):
        return None
    keep_unschedulable = annotations.get(KEPT_ANNOTATION) == "true"
    spec: dict[str, Any] = {"taints": [taint for taint in _taints(node) if taint["key"] != TAINT_KEY]}
    if not keep_unschedulable and cordoned_by_us(node):
        spec["unschedulable"] = False
    return {
        "metadata": {"resourceVersion": _resource_version(node), "annotations": dict.fromkeys(_ANNOTATIONS)},
        "spec": spec,
    }
