"""A local Kubernetes cluster for the stack (`scheduler="kubernetes"`, docs/kubernetes.md): a real etcd and
kube-apiserver (kube_server.py), set up as an operator would set up a cluster for Reprise, and the kubelet double
(kubelet.py) playing every node's kubelet.

Set up as the cluster's admin: the orchestrator's namespace and the jobs' one, the orchestrator's ServiceAccount and
its least-privilege roles (reprise_orchestrator.compute.kubernetes.rbac, bound as in deploy/), and one Node per node
and spare, labelled for training (`reprise.dev/role=worker|spare`, what the orchestrator's default node selector
expects) and Ready. The orchestrator then runs the kubernetes backend with its ServiceAccount's token: every pod it
creates is bound to a node, and the kubelet double runs it as a local process there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reprise_cli.kube import apiserver_path, build_unavailable_reason
from reprise_cli.kube_server import BACKEND_NAMESPACE, KubeApiServer, start_kube_apiserver, stop_and_remove
from reprise_cli.kubelet import KubeHttp, KubeletThread, register_node
from reprise_common.errors import ConfigError
from reprise_orchestrator.compute.kubernetes import rbac  # the orchestrator's own roles (plain data), as deploy/ has

JOBS_NAMESPACE = "reprise-jobs"
ROLE_LABEL = "reprise.dev/role"  # workers and spares: the nodes labelled for training
NODE_SELECTOR = f"{ROLE_LABEL} in (worker,spare)"
_RBAC = "/apis/rbac.authorization.k8s.io/v1"


def kube_unavailable_reason() -> str | None:
    """Why no local API server can run here (not built and cannot be), or None."""
    return None if apiserver_path().is_file() else build_unavailable_reason()


def _create_path(manifest: dict[str, Any]) -> str:
    """Where a manifest of the kinds the setup applies is created."""
    kind, namespace = manifest["kind"], manifest["metadata"].get("namespace")
    paths = {
        "ServiceAccount": f"/api/v1/namespaces/{namespace}/serviceaccounts",
        "ClusterRole": f"{_RBAC}/clusterroles",
        "ClusterRoleBinding": f"{_RBAC}/clusterrolebindings",
        "Role": f"{_RBAC}/namespaces/{namespace}/roles",
        "RoleBinding": f"{_RBAC}/namespaces/{namespace}/rolebindings",
    }
    return paths[kind]


def listening_ports(pid: int) -> list[int]:
    """The TCP ports process `pid` itself listens on (its sockets, read from /proc); none for a process gone. A file
    the process closes while its descriptors are read is passed over, not taken for the process's end."""
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return []
    inodes = set()
    for fd in fds:
        try:
            link = os.readlink(fd)
        except OSError:
            continue  # closed since the listing
        if link.startswith("socket:["):
            inodes.add(link[len("socket:[") : -1])
    ports = []
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(set(ports))


@dataclass
class KubeCluster:
    """The API server, its setup and the kubelet double of the stack's nodes; stopped (and removed) with the stack."""

    directory: Path
    nodes: list[tuple[str, bool]]  # (node, spare)
    logs: Path
    server: KubeApiServer | None = None
    kubelet: KubeletThread | None = None
    _losses: list[concurrent.futures.Future[None]] = field(default_factory=list)

    @property
    def token_file(self) -> Path:
        """The orchestrator's ServiceAccount token (REPRISE_KUBERNETES_TOKEN_FILE)."""
        return self.directory / "orchestrator.token"

    @property
    def kubeconfig(self) -> Path:
        """The admin's kubeconfig, for `kubectl --kubeconfig` while the stack runs."""
        return self.directory / "kubeconfig"

    def _write_kubeconfig(self, server: KubeApiServer) -> None:
        cluster = {"name": "reprise", "cluster": {"server": server.url, "certificate-authority": str(server.ca_file)}}
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [cluster],
            "users": [{"name": "admin", "user": {"token": server.admin_token}}],
            "contexts": [{"name": "reprise", "context": {"cluster": "reprise", "user": "admin"}}],
            "current-context": "reprise",
        }
        self.kubeconfig.write_text(json.dumps(config, indent=1))  # JSON is YAML: kubectl reads it
        self.kubeconfig.chmod(0o600)

    def start(self) -> None:
        """Start etcd and the API server, set the cluster up as its admin, and start the kubelet double."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self.server = start_kube_apiserver(self.directory)
        self.token_file.write_text(self.server.backend_token)
        self.token_file.chmod(0o600)
        self._write_kubeconfig(self.server)
        names = {node for node, _spare in self.nodes}
        self.kubelet = KubeletThread(
            self.server.url, self.server.admin_token, self.server.ca_file, JOBS_NAMESPACE, names, logs=self.logs
        )
        api = self.kubelet.open()
        self.kubelet.call(self._set_up(api))
        self.kubelet.start()

    def orchestrator_env(self) -> dict[str, str]:
        """Where the orchestrator reaches the API server, as whom, and the CA it trusts."""
        assert self.server is not None
        return {
            "REPRISE_KUBERNETES_API_URL": self.server.url,
            "REPRISE_KUBERNETES_TOKEN_FILE": str(self.token_file),
            "REPRISE_KUBERNETES_CA_FILE": str(self.server.ca_file),
        }

    async def _set_up(self, api: KubeHttp) -> None:
        for namespace in (BACKEND_NAMESPACE, JOBS_NAMESPACE):
            await api.call("POST", "/api/v1/namespaces", {"metadata": {"name": namespace}})
        for manifest in rbac.manifests(BACKEND_NAMESPACE, JOBS_NAMESPACE):
            await api.call("POST", _create_path(manifest), manifest)
        for node, spare in self.nodes:
            await register_node(api, node, labels={ROLE_LABEL: "spare" if spare else "worker"})

    def _on_loop(self, work: Callable[[KubeHttp], Any], timeout_s: float = 30.0) -> Any:
        assert self.kubelet is not None and self.kubelet.api is not None
        return self.kubelet.call(work(self.kubelet.api), timeout_s=timeout_s)

    def read_node(self, node: str) -> dict[str, Any]:
        """The Node as the API server has it (JSON)."""
        return self._on_loop(lambda api: api.call("GET", f"/api/v1/nodes/{node}"))  # type: ignore[no-any-return]

    def pods(self) -> list[dict[str, Any]]:
        """The jobs' namespace's pods as the API server has them (JSON)."""
        found = self._on_loop(lambda api: api.call("GET", f"/api/v1/namespaces/{JOBS_NAMESPACE}/pods"))
        return list(found.get("items", []))

    def lose_node(self, node: str) -> None:
        """The node is lost from now on: its pods' processes end (an injected node loss ends its agent first; what
        is left is killed after 3 s), its kubelet writes nothing more, and the Node turns NotReady. Returns at once."""
        assert self.kubelet is not None and self.kubelet.kubelet is not None
        loss = asyncio.run_coroutine_threadsafe(self.kubelet.kubelet.lose(node), self.kubelet.loop)
        self._losses.append(loss)

    def agent_url(self, node: str, host: str) -> str:
        """The HTTP address of the agent of the live pod on `node` (agents listen on any free port: they all share
        this host's address)."""
        assert self.kubelet is not None and self.kubelet.kubelet is not None
        for pid in self.kubelet.kubelet.pids_on(node):
            for port in listening_ports(pid):
                return f"http://{host}:{port}"
        raise ConfigError(f"no pod's agent listens on node {node}")

    def stop(self) -> None:
        """End the pods' processes, then stop the API server and etcd and remove their directory."""
        if self.kubelet is not None:
            for loss in self._losses:
                loss.cancel()
            self.kubelet.stop()
            self.kubelet = None
        if self.server is not None:
            stop_and_remove(self.server)
            self.server = None
        for secret in (self.token_file, self.kubeconfig):  # their server is gone
            secret.unlink(missing_ok=True)

    def pids(self) -> list[int]:
        """The API server's and etcd's processes."""
        if self.server is None:
            return []
        processes = [self.server.process, self.server.etcd.process]
        return [p.pid for p in processes if p is not None and p.proc is not None]
