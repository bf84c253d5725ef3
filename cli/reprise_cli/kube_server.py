"""A real Kubernetes API server on this host, for the tests: etcd and kube-apiserver on free loopback ports.

The binary is Debian's v1.20.2, built once and cached (kube.py). The server runs as a cluster's would: a self-signed
serving certificate (openssl), a service-account key pair, the RBAC authorizer and a static token file, with an
admin's token (group system:masters) and a token for the orchestrator's identity, authenticated as the
ServiceAccount `reprise-system/reprise-orchestrator` would be, so RBAC bindings to that ServiceAccount apply to it.
There is no controller-manager, hence no `default` service account and no node controller: the ServiceAccount and
TaintNodesByCondition admission plugins are off (the latter's not-ready taint on a new node would never be lifted).
Everything of one server (etcd's data, certificates, tokens, logs) lives in its own directory, removed on stop.
"""

from __future__ import annotations

import base64
import secrets
import shutil
import ssl
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from reprise_cli.kube import ensure_apiserver
from reprise_cli.ports import free_port, with_port_retries
from reprise_cli.servers import ManagedProcess, ServerProcess, answers
from reprise_common.errors import ConfigError

BACKEND_NAMESPACE = "reprise-system"
BACKEND_SERVICE_ACCOUNT = "reprise-orchestrator"
BACKEND_USER = f"system:serviceaccount:{BACKEND_NAMESPACE}:{BACKEND_SERVICE_ACCOUNT}"
_BACKEND_GROUPS = f"system:serviceaccounts,system:serviceaccounts:{BACKEND_NAMESPACE}"


@dataclass
class EtcdServer(ServerProcess):
    """Debian's etcd 3.4, one member on loopback ports, its data in a directory of ours."""

    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    process: ManagedProcess | None = None

    @property
    def ports(self) -> tuple[int, ...]:
        """The client and peer ports."""
        return (self.client_port, self.peer_port)

    @property
    def url(self) -> str:
        """Where kube-apiserver reaches it."""
        return f"http://127.0.0.1:{self.client_port}"

    def start(self, timeout_s: float = 20.0) -> None:
        """Start one member and wait until it is healthy."""
        etcd = shutil.which("etcd")
        if etcd is None:
            raise ConfigError("etcd not found: install Debian's etcd-server (reprise_cli.kube.ensure_apiserver does)")
        peer = f"http://127.0.0.1:{self.peer_port}"
        argv = [
            etcd,
            "--name", "reprise",
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.url,
            "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"reprise={peer}",
            "--log-level", "warn",
        ]  # fmt: skip
        self._launch("etcd", argv, timeout_s=timeout_s)

    def ready(self) -> bool:
        """etcd says it is healthy."""
        return answers(f"{self.url}/health")

    def compact(self) -> int:
        """Compact etcd's history up to its current revision (as its periodic compaction would): a watch from an older
        resourceVersion then ends with 410 Gone. The revision compacted at."""
        # A write of our own (outside the API server's /registry) first: compacting at the revision of the last change
        # to an object would keep that change, and a watch from just before it would fail on its missing prevKv.
        key, value = (base64.b64encode(text).decode() for text in (b"/reprise-tests/compaction", b"x"))
        revision = int(_etcd_post(f"{self.url}/v3/kv/put", {"key": key, "value": value})["header"]["revision"])
        _etcd_post(f"{self.url}/v3/kv/compaction", {"revision": str(revision), "physical": True})
        return revision


@dataclass
class KubeApiServer(ServerProcess):
    """kube-apiserver with RBAC and static tokens over its etcd; `url`, `ca_file` and the tokens reach it."""

    port: int
    directory: Path
    etcd: EtcdServer
    log_path: Path
    admin_token: str = field(default_factory=lambda: secrets.token_hex(16))
    backend_token: str = field(default_factory=lambda: secrets.token_hex(16))
    process: ManagedProcess | None = None

    @classmethod
    def on_free_ports(cls, directory: Path) -> KubeApiServer:
        """A server and its etcd on free ports, everything under `directory`."""
        etcd = EtcdServer(free_port(), free_port(), directory / "etcd", directory / "etcd.log")
        return cls(free_port(), directory, etcd, directory / "kube-apiserver.log")

    @property
    def ports(self) -> tuple[int, ...]:
        """The secure port (there is no insecure one)."""
        return (self.port,)

    @property
    def url(self) -> str:
        """The API server's address."""
        return f"https://127.0.0.1:{self.port}"

    @property
    def ca_file(self) -> Path:
        """The self-signed serving certificate, which clients trust."""
        return self.directory / "serving.crt"

    def start(self, timeout_s: float = 60.0) -> None:
        """Start etcd, then the API server, and wait until /readyz says ready (RBAC's bootstrap roles included)."""
        binary = ensure_apiserver()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._write_credentials()
        self.etcd.start()
        try:
            self._launch("kube-apiserver", [str(binary), *self._flags()], timeout_s=timeout_s)
        except BaseException:
            self.etcd.stop()
            raise

    def ready(self) -> bool:
        """/readyz answers ok to the admin."""
        headers = {"Authorization": f"Bearer {self.admin_token}"}
        try:
            verify = ssl.create_default_context(cafile=str(self.ca_file))
            answer = httpx.get(f"{self.url}/readyz", headers=headers, verify=verify, timeout=2.0)
        except httpx.HTTPError:
            return False
        return answer.status_code == 200

    def stop(self) -> None:
        """Stop the API server and etcd; their directory stays (stop_and_remove removes it)."""
        super().stop()
        self.etcd.stop()

    def _flags(self) -> list[str]:
        d = self.directory
        return [
            f"--etcd-servers={self.etcd.url}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={self.port}",
            "--insecure-port=0",
            f"--cert-dir={d / 'certs'}",
            f"--tls-cert-file={d / 'serving.crt'}",
            f"--tls-private-key-file={d / 'serving.key'}",
            f"--token-auth-file={d / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            f"--service-account-key-file={d / 'sa.pub'}",
            f"--service-account-signing-key-file={d / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc",
            "--service-cluster-ip-range=10.96.0.0/24",
            # No controller-manager: no `default` ServiceAccount, and no node controller to lift the not-ready taint
            # that TaintNodesByCondition puts on every new node.
            "--disable-admission-plugins=ServiceAccount,TaintNodesByCondition",
            # Watches of nodes and pods come from etcd itself, so that compacting etcd (EtcdServer.compact) expires a
            # watch (410) at once, as a long-lived watch expires on a real cluster.
            "--watch-cache-sizes=nodes#0,pods#0",
            "--profiling=false",
        ]

    def _write_credentials(self) -> None:
        """The serving certificate (for 127.0.0.1), the service-account key pair and the token file."""
        d = self.directory
        _openssl(
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1",
            "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout", str(d / "serving.key"), "-out", str(d / "serving.crt"),
        )  # fmt: skip
        _openssl("genrsa", "-out", str(d / "sa.key"), "2048")
        _openssl("rsa", "-in", str(d / "sa.key"), "-pubout", "-out", str(d / "sa.pub"))
        (d / "tokens.csv").write_text(
            f'{self.admin_token},admin,admin,"system:masters"\n'
            f'{self.backend_token},{BACKEND_USER},reprise-orchestrator-uid,"{_BACKEND_GROUPS}"\n'
        )
        (d / "tokens.csv").chmod(0o600)


def _etcd_post(url: str, body: dict[str, object]) -> dict[str, Any]:
    """One call to etcd's JSON gateway."""
    answer = httpx.post(url, json=body, timeout=5.0)
    answer.raise_for_status()
    found = answer.json()
    if not isinstance(found, dict):
        raise ConfigError(f"etcd answered {url} with {found!r}")
    return found


def _openssl(*args: str) -> None:
    result = subprocess.run(["openssl", *args], capture_output=True, text=True, timeout=60, check=False)
    if result.returncode != 0:
        raise ConfigError(f"openssl {args[0]} failed: {result.stderr.strip()[-500:]}")


def start_kube_apiserver(directory: Path | None = None) -> KubeApiServer:
    """An API server and its etcd on free ports, in a new directory under `directory` (default: the system's
    temporary one), started (again on other ports when one was taken)."""

    def launch() -> KubeApiServer:
        server = KubeApiServer.on_free_ports(Path(tempfile.mkdtemp(prefix="reprise-kube-", dir=directory)))
        server.start()
        return server

    return with_port_retries(launch)


def stop_and_remove(server: KubeApiServer) -> None:
    """Stop the API server and etcd, and remove their directory."""
    server.stop()
    shutil.rmtree(server.directory, ignore_errors=True)
