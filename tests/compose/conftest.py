"""docker-compose.yml started for real: a dockerd of the session's own, every image built here on the platform image
(Debian's packages, reprise_cli.dockerd; nothing is pulled from a registry), the whole topology brought up with
Debian's docker-compose, and everything (containers, network, volumes) taken down at the end.

The daemon keeps its data root in the cache (~/.cache/reprise/compose-docker), so docker's build cache holds between
runs: only the layers whose files changed are built again. Two sessions on one machine take turns (a file lock).

What differs from `docker-compose -p reprise up` on a developer's machine is only what belongs to the host: the
credentials come from a directory of the test's own, every published port is a free one on 127.0.0.1, and the network
gets a subnet no other route on this machine uses.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import random
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from reprise_cli.compose_images import prepare_compose
from reprise_cli.creds import ADMIN, init_credentials, seed_file
from reprise_cli.dockerd import DockerDaemon, cache_dir, docker_unavailable_reason
from reprise_common.errors import ConfigError

docker = pytest.importorskip("docker", reason="the docker SDK is not installed")

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
NODES = ("node-1", "node-2", "spare-1")  # the agents docker-compose.yml runs
SERVICE_UID = 10001  # the user the services' images run as (deploy/docker/Dockerfile.*): it must read its seed
BUILD_TIMEOUT_S = 900  # cold: the wheels and every image; warm: seconds
UP_TIMEOUT_S = 240  # compose starts the services in depends_on order, each after the last is healthy


def compose_unavailable_reason() -> str | None:
    """Why the compose topology cannot be started here (None: it can)."""
    if (reason := docker_unavailable_reason()) is not None:
        return reason
    if shutil.which("docker-compose") is None:
        return "docker-compose is not installed: `make docker-deps` installs Debian's (1.29) as root"
    return None


@dataclass
class Compose:
    """One started compose project: its command line, its daemon and the credentials it was given."""

    project: str
    file: Path
    env: dict[str, str]
    client: Any  # docker.DockerClient
    creds: Path
    admin_api_key: str

    def run(self, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        """docker-compose with this project's file and daemon; raises with its output when it fails."""
        argv = ["docker-compose", "--no-ansi", "-p", self.project, "-f", str(self.file), *args]
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout_s, check=False)
        if done.returncode != 0:
            raise AssertionError(f"{' '.join(argv[4:])} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        return done

    def containers(self) -> dict[str, Any]:
        """The project's containers by compose service name."""
        found = self.client.containers.list(all=True, filters={"label": f"com.docker.compose.project={self.project}"})
        return {c.labels["com.docker.compose.service"]: c for c in found}

    def url(self, service: str, port: int) -> str:
        """http:// of a service's published container port, as the host reaches it."""
        container = self.containers()[service]
        container.reload()
        binding = container.ports[f"{port}/tcp"][0]
        return f"http://{binding['HostIp']}:{binding['HostPort']}"

    def nats_url(self) -> str:
        """The NATS client port as the host reaches it."""
        return self.url("nats", 4222).replace("http://", "nats://")

    def health(self) -> dict[str, str]:
        """Each container's healthcheck status (or its state, where it has stopped)."""
        states: dict[str, str] = {}
        for name, container in self.containers().items():
            state = container.attrs["State"]
            states[name] = state.get("Health", {}).get("Status", "none") if state["Running"] else state["Status"]
        return states

    def logs(self, tail: int = 40) -> str:
        """The end of every container's log."""
        return self.run("logs", "--no-color", f"--tail={tail}", timeout_s=60).stdout


def _subnet() -> str:
    """A /24 in 10.0.0.0/8 that no route of this machine covers (other daemons' networks included)."""
    routes = []
    for line in Path("/proc/net/route").read_text().splitlines()[1:]:
        fields = line.split()
        network = ipaddress.IPv4Address(bytes.fromhex(fields[1])[::-1])
        mask = ipaddress.IPv4Address(bytes.fromhex(fields[7])[::-1])
        if int(mask):
            routes.append(ipaddress.IPv4Network(f"{network}/{mask}", strict=False))
    while True:
        candidate = ipaddress.IPv4Network(f"10.{random.randint(100, 250)}.{random.randint(0, 255)}.0/24")
        if not any(candidate.overlaps(route) for route in routes):
            return str(candidate)


def _host_side(volume: str, creds: Path) -> str:
    """A bind mount's source as an absolute path, deploy/creds moved to the test's own credentials."""
    source, _, rest = volume.partition(":")
    if source.startswith("./deploy/creds/"):
        return f"{creds / source.removeprefix('./deploy/creds/')}:{rest}"
    if source.startswith("./"):
        return f"{REPO / source.removeprefix('./')}:{rest}"
    return volume


def _on_a_free_port(port: str) -> str:
    """'[host_ip:]host_port:container_port' as a port docker picks on 127.0.0.1."""
    return f"127.0.0.1::{port.rsplit(':', 1)[-1]}"


def write_compose_file(directory: Path, creds: Path, subnet: str) -> Path:
    """docker-compose.yml with the host's side (credentials, published ports, the network's subnet) made the test's."""
    document = yaml.safe_load(COMPOSE_FILE.read_text())
    for service in document["services"].values():
        if isinstance(service.get("build"), dict):
            service["build"] = {**service["build"], "context": str(REPO / service["build"]["context"])}
        service["volumes"] = [_host_side(volume, creds) for volume in service.get("volumes", [])]
        service["ports"] = [_on_a_free_port(str(port)) for port in service.get("ports", [])]
    document["networks"] = {"default": {"ipam": {"config": [{"subnet": subnet}]}}}
    path = directory / "docker-compose.yml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def _credentials(directory: Path) -> Path:
    """`reprise creds` for the topology's nodes; each service's seed owned by the user its container runs as."""
    init_credentials(directory, nodes=list(NODES), base_config=REPO / "deploy" / "nats" / "nats.conf")
    admin = seed_file(directory, ADMIN)
    for seed in directory.glob("*.nk"):
        if seed != admin:
            os.chown(seed, SERVICE_UID, SERVICE_UID)
    return directory


@pytest.fixture(scope="module")
def compose(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Compose]:
    """docker-compose.yml built and up, every service healthy; taken down with its volumes at the end."""
    if (reason := compose_unavailable_reason()) is not None:
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("compose")
    lock_path = cache_dir() / "compose-docker.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one daemon at a time on the cached data root
        daemon = DockerDaemon(work / "dockerd", data_root=cache_dir() / "compose-docker")
        try:
            daemon.start()
        except ConfigError as exc:
            pytest.skip(f"no Docker Engine here: {exc}")
        client = docker.DockerClient(base_url=daemon.url, timeout=120)
        try:
            yield from _up(work, daemon, client)
        finally:
            client.close()
            daemon.stop()


def _up(work: Path, daemon: DockerDaemon, client: Any) -> Iterator[Compose]:
    """Build, start and wait for every service; down (volumes and images left dangling too) afterwards."""
    started = time.monotonic()
    prepare_compose(REPO, daemon.url)
    prepared = time.monotonic()
    creds = _credentials(work / "creds")
    keys = {name: secrets.token_urlsafe(32) for name in ("ADMIN_API_KEY", "READ_API_KEY", "REDIS_PASSWORD")}
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "DOCKER_HOST": daemon.url,
        "COMPOSE_DOCKER_CLI_BUILD": "0",  # docker-compose's own builder: no BuildKit, which would look for a registry
        "DOCKER_BUILDKIT": "0",
        **{f"REPRISE_{name}": value for name, value in keys.items()},
    }
    stack = Compose(
        project=f"reprise-test-{secrets.token_hex(3)}",
        file=write_compose_file(work, creds, _subnet()),
        env=env,
        client=client,
        creds=creds,
        admin_api_key=keys["ADMIN_API_KEY"],
    )
    try:
        stack.run("build", timeout_s=BUILD_TIMEOUT_S)
        built = time.monotonic()
        try:
            stack.run("up", "-d", timeout_s=UP_TIMEOUT_S)  # each service after those it depends on are healthy
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{stack.logs()}") from None
        deadline = time.monotonic() + UP_TIMEOUT_S
        while set(stack.health().values()) != {"healthy"} and time.monotonic() < deadline:
            time.sleep(1)
        print(
            f"compose: platform image and wheels {prepared - started:.0f} s, build {built - prepared:.0f} s, "
            f"up and healthy {time.monotonic() - built:.0f} s"
        )
        yield stack
    finally:
        try:
            stack.run("down", "-v", "--remove-orphans", "-t", "5", timeout_s=120)
        finally:
            client.images.prune(filters={"dangling": True})  # what a rebuild replaced; the build cache stays
