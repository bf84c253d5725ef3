"""The least privilege the kubernetes backend needs, as manifests: a ServiceAccount, a ClusterRole for nodes and a
namespaced Role for the job's pods and events, each bound to the ServiceAccount.

Nodes are cluster-scoped, so reading, watching and cordoning them (get, list, watch, patch) needs a ClusterRole; the
pods that run the agents and the events that explain them live in the jobs' namespace, so a Role there (create,
delete, get, list, watch) is all the rest. Nothing else: no secrets, no deletes of nodes, nothing in other namespaces.
The tests apply these to a real API server and run the backend with that identity under its RBAC authorizer.
"""

from __future__ import annotations

from typing import Any

NAME = "reprise-orchestrator"
NODE_VERBS = ("get", "list", "watch", "patch")
POD_VERBS = ("create", "delete", "get", "list", "patch", "watch")  # patch: marking a pod Reprise releases


def service_account(namespace: str, name: str = NAME) -> dict[str, Any]:
    """The backend's identity."""
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": namespace}}


def node_cluster_role(name: str = NAME) -> dict[str, Any]:
    """Read, watch and cordon nodes."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": list(NODE_VERBS)}],
    }


def pod_role(jobs_namespace: str, name: str = NAME) -> dict[str, Any]:
    """Run the job's pods and report on them, in the jobs' namespace only."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": name, "namespace": jobs_namespace},
        "rules": [{"apiGroups": [""], "resources": ["pods", "events"], "verbs": list(POD_VERBS)}],
    }


def _subject(namespace: str, name: str) -> list[dict[str, str]]:
    return [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]


def bindings(namespace: str, jobs_namespace: str, name: str = NAME) -> list[dict[str, Any]]:
    """The ClusterRoleBinding and the RoleBinding that give the ServiceAccount its two roles."""
    group = "rbac.authorization.k8s.io"
    return [
        {
            "apiVersion": f"{group}/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": name},
            "roleRef": {"apiGroup": group, "kind": "ClusterRole", "name": name},
            "subjects": _subject(namespace, name),
        },
        {
            "apiVersion": f"{group}/v1",
            "kind": "RoleBinding",
            "metadata": {"name": name, "namespace": jobs_namespace},
            "roleRef": {"apiGroup": group, "kind": "Role", "name": name},
            "subjects": _subject(namespace, name),
        },
    ]


def manifests(namespace: str, jobs_namespace: str, name: str = NAME) -> list[dict[str, Any]]:
    """Every RBAC object of the backend, in the order they can be applied (namespaces are the operator's)."""
    return [
        service_account(namespace, name),
        node_cluster_role(name),
        pod_role(jobs_namespace, name),
        *bindings(namespace, jobs_namespace, name),
    ]
