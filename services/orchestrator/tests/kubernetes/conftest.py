"""A real Kubernetes API server for the kubernetes backend's tests: Debian's kube-apiserver v1.20.2 (built once and
cached on the machine by reprise_cli.kube) over etcd, with RBAC and static tokens, and the backend's RBAC manifests
applied. Skipped, with the reason, only where it can be neither found in the cache nor built (not root, no Debian
mirror)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from reprise_cli.kube import apiserver_path, build_unavailable_reason
from reprise_cli.kube_server import BACKEND_NAMESPACE, KubeApiServer, start_kube_apiserver, stop_and_remove
from reprise_common.bus import Bus
from reprise_common.clock import SystemClock
from reprise_orchestrator.compute.agents.backend import AgentsBackend
from reprise_orchestrator.compute.kubernetes import rbac
from reprise_orchestrator.compute.kubernetes.api import KubeAccess, KubeApi
from reprise_orchestrator.compute.kubernetes.backend import KubernetesBackend
from reprise_orchestrator.compute.kubernetes.jobpods import PodSettings
from reprise_orchestrator.inventory import Inventory
from reprise_orchestrator.settings import OrchestratorSettings

from .cluster import JOBS_NAMESPACE, OTHER_NAMESPACE, Admin

FIRST_BUILD_TIMEOUT_S = 1800  # building kube-apiserver takes 5-11 minutes, once per machine (see docs/kubernetes.md)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Where kube-apiserver is not built yet, the first test here builds it: these tests then get the build's time."""
    if apiserver_path().is_file():
        return
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.timeout(FIRST_BUILD_TIMEOUT_S))


@pytest.fixture(scope="session")
def kube_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeApiServer]:
    """The session's API server, its namespaces and the backend's ServiceAccount, roles and bindings applied."""
    reason = build_unavailable_reason()
    if reason is not None:
        pytest.skip(f"no kube-apiserver: {reason}")
    server = start_kube_apiserver(tmp_path_factory.mktemp("kube"))
    try:
        asyncio.run(_apply_rbac(server))
        yield server
    finally:
        stop_and_remove(server)


async def _apply_rbac(server: KubeApiServer) -> None:
    admin = Admin(server)
    try:
        for namespace in (BACKEND_NAMESPACE, JOBS_NAMESPACE, OTHER_NAMESPACE):
            await admin.create_namespace(namespace)
        for manifest in rbac.manifests(BACKEND_NAMESPACE, JOBS_NAMESPACE):
            await admin.apply(manifest)
    finally:
        await admin.close()


@pytest.fixture
async def admin(kube_server: KubeApiServer) -> AsyncIterator[Admin]:
    """The cluster's admin (system:masters), for what the tests do beside the backend: nodes, kubelet's statuses."""
    found = Admin(kube_server)
    yield found
    await found.close()


def backend_access(server: KubeApiServer) -> KubeAccess:
    """The backend's identity: the ServiceAccount the RBAC manifests bind."""
    return KubeAccess(url=server.url, token=server.backend_token, ca_file=str(server.ca_file), timeout_s=10.0)


def open_backend(
    api: KubeApi, tmp_path: Path, *, label_selector: str | None = None, pods: PodSettings | None = None
) -> KubernetesBackend:
    """The backend on `api`, its agents never reached (launch and stop are the agents' and not exercised here);
    with `pods`, it creates the jobs' pods."""
    settings = OrchestratorSettings(database_url=f"sqlite:///{tmp_path / 'o.db'}")
    agents = AgentsBackend(
        bus=Bus.for_service(settings, "orchestrator"),
        inventory=Inventory(clock=SystemClock(), stale_s=3600),
        command_timeout_s=5.0,
        stop_grace_s=1.0,
    )
    return KubernetesBackend(
        agents=agents, api=api, label_selector=label_selector, pods=pods, watch_timeout_s=5, retry_s=0.2
    )


@pytest.fixture
async def backend(kube_server: KubeApiServer, tmp_path: Path) -> AsyncIterator[KubernetesBackend]:
    """The kubernetes backend with its own identity (only what its roles grant)."""
    found = open_backend(KubeApi(backend_access(kube_server)), tmp_path)
    yield found
    await found.close()
