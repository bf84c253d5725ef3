"""Cordon and uncordon against the real API server, as the backend's own identity: the node read back is
unschedulable with Reprise's taint and the incident in its annotations; an uncordon lifts only that (an admin's cordon,
and anyone's taint, stay); a write whose resourceVersion went stale (409) is read again and retried, never clobbering
the change made meanwhile."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kubernetes.aio.client import V1Node

from reprise_cli.kube_server import KubeApiServer
from reprise_orchestrator.compute.kubernetes.api import KubeAccess, KubeApi, KubeConflictError, KubeNotFoundError
from reprise_orchestrator.compute.kubernetes.backend import KubernetesBackend
from reprise_orchestrator.compute.kubernetes.cordon import INCIDENT_ANNOTATION, REASON_ANNOTATION, TAINT_KEY

from .cluster import Admin, unique
from .conftest import backend_access, open_backend

REASON = "incident inc-79: XID 79 (GPU fell off the bus) on gpu 3"


def taints(node: object) -> dict[str, str]:
    """The node's taints, key → value:effect."""
    return {t.key: f"{t.value or ''}:{t.effect}" for t in node.spec.taints or []}  # type: ignore[attr-defined]


async def test_cordon_marks_the_node_and_uncordon_lifts_it(admin: Admin, backend: KubernetesBackend) -> None:
    name = unique("node")
    await admin.create_node(name)

    await backend.cordon(name, reason=REASON)
    node = await admin.node(name)
    assert node.spec.unschedulable is True
    assert taints(node) == {TAINT_KEY: "inc-79:NoSchedule"}
    assert node.metadata.annotations[INCIDENT_ANNOTATION] == "inc-79"
    assert node.metadata.annotations[REASON_ANNOTATION] == REASON
    cordoned_at = node.metadata.resource_version

    await backend.cordon(name, reason=REASON)  # repeated: nothing to write
    assert (await admin.node(name)).metadata.resource_version == cordoned_at

    await backend.uncordon(name)
    node = await admin.node(name)
    assert not node.spec.unschedulable
    assert taints(node) == {}
    assert not any(key.startswith("reprise.dev/") for key in node.metadata.annotations or {})


async def test_uncordon_leaves_an_admins_cordon_and_taint(admin: Admin, backend: KubernetesBackend) -> None:
    name = unique("node")
    await admin.create_node(name)
    await admin.cordon(name)
    await admin.add_taint(name, "example.com/maintenance")

    await backend.cordon(name, reason=REASON)
    node = await admin.node(name)
    assert node.spec.unschedulable is True
    assert taints(node) == {"example.com/maintenance": "maintenance:NoSchedule", TAINT_KEY: "inc-79:NoSchedule"}

    await backend.uncordon(name)
    node = await admin.node(name)
    assert node.spec.unschedulable is True, "the admin's cordon was lifted"
    assert taints(node) == {"example.com/maintenance": "maintenance:NoSchedule"}
    assert not any(key.startswith("reprise.dev/") for key in node.metadata.annotations or {})


async def test_uncordon_of_a_node_reprise_never_cordoned_changes_nothing(
    admin: Admin, backend: KubernetesBackend
) -> None:
    name = unique("node")
    await admin.create_node(name)
    await admin.cordon(name)
    before = (await admin.node(name)).metadata.resource_version

    await backend.uncordon(name)
    node = await admin.node(name)
    assert node.spec.unschedulable is True
    assert node.metadata.resource_version == before


class RacedApi(KubeApi):
    """The backend's adapter, with an admin changing the node right after each of the first `races` reads: the
    backend's patch then carries a stale resourceVersion, and the real server refuses it (409)."""

    def __init__(self, access: KubeAccess, *, admin: Admin, races: int) -> None:
        super().__init__(access)
        self.admin = admin
        self.races = races
        self.reads = 0
        self.conflicts = 0

    async def get_node(self, name: str) -> V1Node:
        node = await super().get_node(name)
        self.reads += 1
        if self.reads <= self.races:
            await self.admin.add_taint(name, f"example.com/race-{self.reads}")
        return node

    async def patch_node(self, name: str, patch: dict[str, Any]) -> V1Node:
        try:
            return await super().patch_node(name, patch)
        except KubeConflictError:
            self.conflicts += 1
            raise


async def test_a_stale_resource_version_is_read_again_and_retried(
    admin: Admin, kube_server: KubeApiServer, tmp_path: Path
) -> None:
    name = unique("node")
    await admin.create_node(name)
    api = RacedApi(backend_access(kube_server), admin=admin, races=2)
    backend = open_backend(api, tmp_path)
    try:
        await backend.cordon(name, reason=REASON)
    finally:
        await backend.close()

    assert api.conflicts == 2 and api.reads == 3
    node = await admin.node(name)
    assert node.spec.unschedulable is True
    # Both taints added between a read and its patch survive: a patch without the resourceVersion would drop them.
    assert set(taints(node)) == {"example.com/race-1", "example.com/race-2", TAINT_KEY}


async def test_conflicts_without_end_give_up_with_the_conflict(
    admin: Admin, kube_server: KubeApiServer, tmp_path: Path
) -> None:
    name = unique("node")
    await admin.create_node(name)
    api = RacedApi(backend_access(kube_server), admin=admin, races=100)
    backend = open_backend(api, tmp_path)
    try:
        with pytest.raises(KubeConflictError) as refused:
            await backend.cordon(name, reason=REASON)
    finally:
        await backend.close()
    assert api.conflicts == backend.write_attempts
    assert refused.value.verb == "patch" and refused.value.resource == "nodes"
    assert not (await admin.node(name)).spec.unschedulable


async def test_cordon_of_an_unknown_node_says_so(backend: KubernetesBackend) -> None:
    with pytest.raises(KubeNotFoundError, match="get nodes"):
        await backend.cordon(unique("no-such-node"), reason=REASON)
