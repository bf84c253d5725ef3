"""The deploy manifests (deploy/kubernetes, a Kustomize base and its overlays), rendered by `kubectl kustomize` and
validated by the real API server (a server-side apply, dry run, as the cluster's admin); their RBAC is rbac.py's,
their services' ports, commands and probes are the stack's (reprise_cli.topology), and they hold no real key."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from reprise_cli.kube_server import BACKEND_NAMESPACE, KubeApiServer
from reprise_cli.topology import DEFAULT_PORTS, ROLE_COMMANDS
from reprise_orchestrator.compute.kubernetes import rbac
from reprise_orchestrator.settings import OrchestratorSettings

from .cluster import JOBS_NAMESPACE

DEPLOY = Path(__file__).resolve().parents[4] / "deploy" / "kubernetes"
OVERLAYS = ["dev", "production"]
SERVICES = ["checkpoint-registry", "detector", "orchestrator", "notifier", "dashboard"]
RBAC_KINDS = {"ServiceAccount", "ClusterRole", "Role", "ClusterRoleBinding", "RoleBinding"}


def _kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        pytest.skip("no kubectl on this machine (it renders the Kustomize overlays)")
    return found


def _render(overlay: str) -> str:
    return subprocess.run(
        [_kubectl(), "kustomize", str(DEPLOY / "overlays" / overlay)], capture_output=True, text=True, check=True
    ).stdout


def _objects(overlay: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(_render(overlay)) if doc]


def _apply_dry_run(server: KubeApiServer, manifests: str) -> subprocess.CompletedProcess[str]:
    """`kubectl apply --server-side --dry-run=server` as the admin: the server validates and admits, stores nothing."""
    access = [f"--server={server.url}", f"--token={server.admin_token}", f"--certificate-authority={server.ca_file}"]
    command = [_kubectl(), *access, "apply", "--server-side", "--dry-run=server", "-f", "-"]
    return subprocess.run(command, check=False, input=manifests, capture_output=True, text=True, timeout=60)


def _by(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [found] = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def _identity(manifest: dict[str, Any]) -> tuple[str, str, str]:
    return manifest["kind"], manifest["metadata"].get("namespace", ""), manifest["metadata"]["name"]


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {item["name"]: item["value"] for item in container.get("env", []) if "value" in item}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_overlay_is_accepted_by_the_api_server(kube_server: KubeApiServer, overlay: str) -> None:
    manifests = _render(overlay)
    result = _apply_dry_run(kube_server, manifests)
    assert result.returncode == 0, result.stderr
    applied = [line for line in result.stdout.splitlines() if line.endswith("serverside-applied (server dry run)")]
    assert len(applied) == len([doc for doc in yaml.safe_load_all(manifests) if doc]), result.stdout


def test_the_server_refuses_a_manifest_it_would_not_run(kube_server: KubeApiServer) -> None:
    objects = _objects("dev")
    _by(objects, "Deployment", "orchestrator")["spec"]["replicas"] = -1
    result = _apply_dry_run(kube_server, yaml.safe_dump_all(objects))
    assert result.returncode != 0
    assert "spec.replicas: Invalid value: -1" in result.stderr, result.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_manifests_rbac_is_rbac_py(overlay: str) -> None:
    found = [o for o in _objects(overlay) if o["kind"] in RBAC_KINDS and o["metadata"]["name"] == rbac.NAME]
    assert sorted(found, key=_identity) == sorted(rbac.manifests(BACKEND_NAMESPACE, JOBS_NAMESPACE), key=_identity)


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_is_ready_on_readyz_at_the_stacks_port(service: str) -> None:
    deployment = _by(_objects("production"), "Deployment", service)
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == [ROLE_COMMANDS[service]]
    [port] = container["ports"]
    assert (port["name"], port["containerPort"]) == ("http", DEFAULT_PORTS[service])
    assert _env(container)["REPRISE_HTTP_PORT"] == str(DEFAULT_PORTS[service])
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    mounted = deployment["spec"]["template"]["spec"]["volumes"][0]["secret"]["items"]
    assert f"{service}.nk" in {item["key"] for item in mounted}  # its own NATS identity, and no other service's
    assert not {item["key"] for item in mounted} & {f"{other}.nk" for other in SERVICES if other != service}


def test_the_agent_may_trace_its_ranks_and_nothing_more() -> None:
    for name in ("reprise-agent", "reprise-agent-spare"):
        spec = _by(_objects("production"), "DaemonSet", name)["spec"]["template"]["spec"]
        [container] = spec["containers"]
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["SYS_PTRACE"]}
        assert container["securityContext"]["privileged"] is False
        assert "hostPID" not in spec and spec["automountServiceAccountToken"] is False
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    dev = _by(_objects("dev"), "DaemonSet", "reprise-agent")["spec"]["template"]["spec"]["containers"][0]
    assert _env(dev)["REPRISE_GPU_BACKEND"] == "sim"


def test_the_orchestrators_allow_list_is_valid_settings(tmp_path: Path) -> None:
    [container] = _by(_objects("production"), "Deployment", "orchestrator")["spec"]["template"]["spec"]["containers"]
    allowed = {key: value for key, value in _env(container).items() if key.startswith("REPRISE_KUBERNETES_")}
    assert set(allowed) == {f"REPRISE_KUBERNETES_{n}" for n in ("NAMESPACES", "NODE_SELECTORS", "SERVICE_ACCOUNTS")}
    with pytest.MonkeyPatch.context() as env:
        for key, value in allowed.items():
            env.setenv(key, value)
        settings = OrchestratorSettings(database_url=f"sqlite:///{tmp_path / 'o.db'}")
    assert settings.kubernetes_namespaces == [JOBS_NAMESPACE]
    assert settings.kubernetes_service_accounts == ["reprise-agent"]


def test_no_real_key_is_in_the_manifests() -> None:
    assert [o for o in _objects("production") if o["kind"] == "Secret"] == []  # applying never overwrites yours
    secrets = [o for o in _objects("dev") if o["kind"] == "Secret"]
    assert {s["metadata"]["name"] for s in secrets} == {
        "reprise-credentials",
        "reprise-nats-creds",
        "reprise-node-seeds",
    }
    for secret in secrets:
        assert "data" not in secret
        assert all("CHANGE-ME" in value for value in secret["stringData"].values()), secret["metadata"]["name"]
    placeholder = _by(secrets, "Secret", "reprise-credentials")["stringData"]["admin-api-key"]
    with pytest.raises(ValueError, match="too weak"):  # a cluster left with the placeholders does not start
        OrchestratorSettings(admin_api_key=placeholder)
