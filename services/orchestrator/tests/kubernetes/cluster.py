"""What the tests do to the API server as its admin: namespaces, RBAC objects, nodes and their conditions (the pods'
statuses are the kubelet double's, reprise_cli.kubelet)."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

from kubernetes.aio import client

from reprise_cli.kube_server import KubeApiServer
from reprise_orchestrator.compute.kubernetes.api import MERGE_PATCH

JOBS_NAMESPACE = "reprise-jobs"
OTHER_NAMESPACE = "someone-else"


def unique(prefix: str) -> str:
    """A name no other test of the session uses (the server is shared)."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


class Admin:
    """The admin's client (group system:masters)."""

    def __init__(self, server: KubeApiServer) -> None:
        configuration = client.Configuration(
            host=server.url, api_key={"BearerToken": server.admin_token}, api_key_prefix={"BearerToken": "Bearer"}
        )
        configuration.ssl_ca_cert = str(server.ca_file)
        self.api_client = client.ApiClient(configuration)
        self.core = client.CoreV1Api(self.api_client)
        self.rbac = client.RbacAuthorizationV1Api(self.api_client)

    async def close(self) -> None:
        """Close the connections."""
        await self.api_client.close()

    async def create_namespace(self, name: str) -> None:
        """A namespace."""
        await self.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))

    async def apply(self, manifest: dict[str, Any]) -> None:
        """Create one RBAC manifest (a ServiceAccount, a Role or ClusterRole, a binding)."""
        kind, namespace = manifest["kind"], manifest["metadata"].get("namespace")
        if kind == "ServiceAccount":
            await self.core.create_namespaced_service_account(namespace, client.V1ServiceAccount.from_dict(manifest))
        elif kind == "ClusterRole":
            await self.rbac.create_cluster_role(client.V1ClusterRole.from_dict(manifest))
        elif kind == "Role":
            await self.rbac.create_namespaced_role(namespace, client.V1Role.from_dict(manifest))
        elif kind == "ClusterRoleBinding":
            await self.rbac.create_cluster_role_binding(client.V1ClusterRoleBinding.from_dict(manifest))
        elif kind == "RoleBinding":
            await self.rbac.create_namespaced_role_binding(namespace, client.V1RoleBinding.from_dict(manifest))
        else:
            raise ValueError(f"no way to apply a {kind}")

    async def create_node(self, name: str, *, labels: dict[str, str] | None = None, ready: bool = True) -> None:
        """A node, Ready as its kubelet would report it."""
        node = client.V1Node(metadata=client.V1ObjectMeta(name=name, labels=labels or {}))
        await self.core.create_node(node)
        await self.set_condition(name, "Ready", "True" if ready else "False", reason="KubeletReady")

    async def set_condition(self, name: str, kind: str, status: str, *, reason: str = "") -> None:
        """Write one condition through the status subresource, as the kubelet or the node controller does."""
        node = await self.node(name)
        kept = [json.loads(c.to_json()) for c in (node.status.conditions or []) if c.type != kind]
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        changed = {"type": kind, "status": status, "reason": reason, "message": f"set by the test: {reason}"}
        wanted = [*kept, changed | {"lastTransitionTime": now, "lastHeartbeatTime": now}]
        await self.core.patch_node_status(name, {"status": {"conditions": wanted}}, _content_type=MERGE_PATCH)

    async def node(self, name: str) -> client.V1Node:
        """The node as the server has it."""
        return await self.core.read_node(name)

    async def cordon(self, name: str) -> None:
        """What `kubectl cordon` does."""
        await self.core.patch_node(name, {"spec": {"unschedulable": True}}, _content_type=MERGE_PATCH)

    async def add_taint(self, name: str, key: str) -> None:
        """Add a NoSchedule taint of someone else's (under the node's resourceVersion)."""
        node = await self.node(name)
        taints = [{"key": t.key, "value": t.value or "", "effect": t.effect} for t in node.spec.taints or []]
        taints.append({"key": key, "value": "maintenance", "effect": "NoSchedule"})
        patch = {"metadata": {"resourceVersion": node.metadata.resource_version}, "spec": {"taints": taints}}
        await self.core.patch_node(name, patch, _content_type=MERGE_PATCH)

    async def delete_node(self, name: str) -> None:
        """Remove a node."""
        await self.core.delete_node(name)

    async def create_pod(self, namespace: str, name: str) -> None:
        """A pod no kubelet will run (none exists), only for the API's sake."""
        pod = client.V1Pod(
            metadata=client.V1ObjectMeta(name=name),
            spec=client.V1PodSpec(containers=[client.V1Container(name="c", image="reprise/agent:test")]),
        )
        await self.core.create_namespaced_pod(namespace, pod)
