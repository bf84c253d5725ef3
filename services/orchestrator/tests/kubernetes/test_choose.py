"""`REPRISE_COMPUTE_BACKEND=kubernetes` builds the backend from the orchestrator's settings (the API server's URL,
the token and CA files, the nodes' label selector, the jobs' namespaces, the agents' launch), which then reads the
real API server as its own identity; a setting that is wrong stops the replica with an error naming it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from reprise_cli.kube_server import KubeApiServer
from reprise_common.bus import Bus
from reprise_common.clock import SystemClock
from reprise_common.errors import ConfigError
from reprise_orchestrator.compute.allocation import AllocatingBackend
from reprise_orchestrator.compute.choose import BackendContext, open_backend
from reprise_orchestrator.compute.kubernetes.backend import KubernetesBackend
from reprise_orchestrator.inventory import Inventory
from reprise_orchestrator.settings import OrchestratorSettings

from .cluster import JOBS_NAMESPACE, Admin, unique
from .test_node_watch import POOL_LABEL, until


def context(tmp_path: Path, **settings: Any) -> BackendContext:
    """What the app hands a backend factory, on these settings."""
    found = OrchestratorSettings(
        database_url=f"sqlite:///{tmp_path / 'o.db'}", compute_backend="kubernetes", **settings
    )
    clock = SystemClock()
    return BackendContext(
        settings=found,
        bus=Bus.for_service(found, "orchestrator"),
        inventory=Inventory(clock=clock, stale_s=5),
        clock=clock,
    )


def token_file(tmp_path: Path, token: str) -> Path:
    path = tmp_path / "token"
    path.write_text(token + "\n")
    return path


async def test_the_kubernetes_backend_is_built_from_settings(
    kube_server: KubeApiServer, admin: Admin, tmp_path: Path
) -> None:
    label = unique("chosen")
    await admin.create_node(f"{label}-0", labels={POOL_LABEL: label})
    await admin.create_node(unique("unlabelled"))
    backend = open_backend(
        context(
            tmp_path,
            kubernetes_api_url=kube_server.url,
            kubernetes_token_file=token_file(tmp_path, kube_server.backend_token),
            kubernetes_ca_file=kube_server.ca_file,
            kubernetes_node_selector=f"{POOL_LABEL}={label}",
            kubernetes_request_timeout_s=5.0,
            slurm_agent_command="reprise-agent --verbose",
        )
    )
    assert isinstance(backend, KubernetesBackend)
    assert isinstance(backend, AllocatingBackend)
    try:
        await backend.nodes.relist(_ignore)  # as its own identity, through its CA, with its selector
        await backend.pods.watches[JOBS_NAMESPACE].relist(_ignore)
        await until(lambda: backend.pods.free_nodes({}) == [f"{label}-0"])
        template = backend.pods.template(None)
        assert (template.namespace, template.launch.argv()) == (JOBS_NAMESPACE, ["reprise-agent", "--verbose"])
        assert backend.api.timeout_s == 5.0
    finally:
        await backend.close()


async def _ignore(_: object) -> None:
    raise AssertionError("a first list signals nothing")


@pytest.mark.parametrize(
    ("settings", "names"),
    [
        ({"kubernetes_token_file": Path("/nonexistent/token")}, "REPRISE_KUBERNETES_TOKEN_FILE='/nonexistent/token'"),
        ({"kubernetes_ca_file": Path("/nonexistent/ca.crt")}, "REPRISE_KUBERNETES_CA_FILE='/nonexistent/ca.crt'"),
        ({"kubernetes_jobs_namespace": "team-b"}, "REPRISE_KUBERNETES_JOBS_NAMESPACE='team-b' is not one of"),
        ({"kubernetes_api_url": None}, "REPRISE_KUBERNETES_API_URL is not set, and this replica does not run in a pod"),
        ({"slurm_agent_env": {"NOT-A-NAME": "1"}}, "REPRISE_SLURM_AGENT_ENV: not environment variable names"),
    ],
)
def test_a_wrong_kubernetes_setting_is_named(
    settings: dict[str, Any], names: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    ca = tmp_path / "ca.crt"
    ca.write_text("not read before the first request\n")
    given: dict[str, Any] = {
        "kubernetes_api_url": "https://127.0.0.1:6443",
        "kubernetes_token_file": token_file(tmp_path, "t"),
        "kubernetes_ca_file": ca,
        **settings,
    }
    with pytest.raises(ConfigError, match=names.replace("(", r"\(")):
        open_backend(context(tmp_path, **given))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("kubernetes_api_url", "127.0.0.1:6443"),
        ("kubernetes_request_timeout_s", 0),
        ("kubernetes_jobs_namespace", "Team_B"),
        ("kubernetes_agent_seeds_secret", "Seeds!"),
    ],
)
def test_a_malformed_kubernetes_setting_is_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(ValidationError, match=field):
        OrchestratorSettings(**{field: value})
