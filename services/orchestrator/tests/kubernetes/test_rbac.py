"""Least privilege, proven by the API server's RBAC authorizer: the backend's identity (the ServiceAccount the
manifests bind) does what its ClusterRole and Role grant, and is refused (403) outside them with an error that names
the verb, the resource and the namespace it lacks."""

from __future__ import annotations

import pytest

from reprise_orchestrator.compute.kubernetes.api import KubeForbiddenError
from reprise_orchestrator.compute.kubernetes.backend import KubernetesBackend

from .cluster import JOBS_NAMESPACE, OTHER_NAMESPACE, Admin, unique


async def test_its_role_grants_the_jobs_pods(admin: Admin, backend: KubernetesBackend) -> None:
    name = unique("agent")
    await admin.create_pod(JOBS_NAMESPACE, name)
    listed = await backend.api.list_pods(JOBS_NAMESPACE)
    assert name in {pod.metadata.name for pod in listed.items}
    await backend.api.delete_pod(JOBS_NAMESPACE, name)


async def test_pods_of_another_namespace_are_refused_by_name(admin: Admin, backend: KubernetesBackend) -> None:
    name = unique("theirs")
    await admin.create_pod(OTHER_NAMESPACE, name)
    with pytest.raises(KubeForbiddenError) as refused:
        await backend.api.delete_pod(OTHER_NAMESPACE, name)
    error = refused.value
    assert (error.verb, error.resource, error.namespace) == ("delete", "pods", OTHER_NAMESPACE)
    assert f"may not delete pods in namespace {OTHER_NAMESPACE}" in str(error)
    assert "reprise-orchestrator" in str(error)  # the server's own words name the identity
    with pytest.raises(KubeForbiddenError, match=f"may not list pods in namespace {OTHER_NAMESPACE}"):
        await backend.api.list_pods(OTHER_NAMESPACE)
    assert name in {pod.metadata.name for pod in (await admin.core.list_namespaced_pod(OTHER_NAMESPACE)).items}
