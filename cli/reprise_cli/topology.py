"""The local stack's topology, in one place: which services run, with which command, environment and ports.

docker-compose.yml describes the same topology for Docker; tests/test_compose_drift.py compares the two.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from reprise_cli.creds import (
    ensure_admin_api_key,
    ensure_read_api_key,
    ensure_redis_password,
    node_keys_file,
    seed_file,
)
from reprise_cli.kube_cluster import JOBS_NAMESPACE, NODE_SELECTOR
from reprise_cli.redis_server import REDIS_USER

CHECKOUT = Path(__file__).resolve().parents[2]  # the repository the CLI is installed editable from

DEFAULT_PORTS: dict[str, int] = {
    "nats": 14222,
    "nats-monitor": 18222,
    "redis": 16379,
    "checkpoint-registry": 8710,
    "detector": 8720,
    "orchestrator": 8730,
    "notifier": 8740,
    "slack-receiver": 8750,  # the local stack's Slack-compatible receiver: the notifier's default destination
    "dashboard": 8760,
    "agent": 8800,  # agents take 8800, 8801, ... in node order
}

# The console script each role runs (also `python -m <package>`); docker-compose uses the same commands.
ROLE_COMMANDS: dict[str, str] = {
    "checkpoint-registry": "reprise-registry",
    "detector": "reprise-detector",
    "orchestrator": "reprise-orchestrator",
    "notifier": "reprise-notifier",
    "dashboard": "reprise-dashboard",
    "agent": "reprise-agent",
}


Runtime = Literal["process", "docker"]  # how the agents run ranks: as processes, or in containers


@dataclass(frozen=True)
class StackConfig:
    """What `reprise up` was asked to run."""

    nodes: int = 4
    spares: int = 1
    gpus_per_node: int = 8
    standbys: int = 0  # warm standby interpreters per node (REPRISE_STANDBYS)
    state_dir: Path = Path(".state")
    host: str = "127.0.0.1"
    ports: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_PORTS))
    # agents: the stack starts one agent per node itself; slurm: a local Slurm cluster of nodes + spares runs the jobs,
    # each job's agents started by srun in its allocation (docs/slurm.md); kubernetes: a local API server and a
    # kubelet double run the jobs, each job's agents in pods the orchestrator creates (docs/kubernetes.md)
    scheduler: Literal["agents", "slurm", "kubernetes"] = "agents"
    # process: ranks run as processes of their agent; docker: the stack runs a dockerd of its own, and a job with a
    # `container` section runs its ranks in containers of the base image (docs/containers.md)
    runtime: Runtime = "process"

    @property
    def creds_dir(self) -> Path:
        """Where the NATS identities of the stack live (`reprise creds`)."""
        return self.state_dir / "creds"

    @property
    def nats_url(self) -> str:
        """Where services reach NATS."""
        return f"nats://{self.host}:{self.ports['nats']}"

    @property
    def redis_url(self) -> str:
        """Where the orchestrator reaches Redis."""
        return f"redis://{self.host}:{self.ports['redis']}/0"

    def http_url(self, port: int) -> str:
        """Base URL of a service on this host."""
        return f"http://{self.host}:{port}"

    @property
    def docker_dir(self) -> Path:
        """Where the dockerd of a `runtime="docker"` stack keeps its socket, data and log (no job may mount it)."""
        return self.state_dir.resolve() / "docker"

    @property
    def docker_url(self) -> str:
        """Where the agents of a `runtime="docker"` stack reach its dockerd."""
        return f"unix://{self.docker_dir / 'docker.sock'}"

    @property
    def jobs_dir(self) -> Path:
        """Where the containerized jobs of this stack keep their working and checkpoint directories (a mount root)."""
        return self.state_dir.resolve() / "jobs"

    @property
    def slurm_dir(self) -> Path:
        """Where the local Slurm cluster of a `scheduler="slurm"` stack keeps its configuration, state and logs."""
        return self.state_dir.resolve() / "slurm"

    @property
    def kube_dir(self) -> Path:
        """Where the local API server of a `scheduler="kubernetes"` stack keeps etcd, certificates and tokens."""
        return self.state_dir.resolve() / "kube"


@dataclass(frozen=True)
class ServiceSpec:
    """One service process of the stack."""

    name: str
    role: str
    command: str
    env: dict[str, str]
    http_port: int


def node_ids(config: StackConfig) -> list[tuple[str, bool]]:
    """Worker node ids then spare node ids, each with whether it is a spare. On Slurm the nodes are the cluster's
    (node1, node2, ...); which of them are a job's spares is decided per allocation."""
    if config.scheduler == "slurm":
        return [(f"node{i}", False) for i in range(1, config.nodes + config.spares + 1)]
    workers = [(f"node-{i}", False) for i in range(1, config.nodes + 1)]
    spares = [(f"spare-{i}", True) for i in range(1, config.spares + 1)]
    return workers + spares


def build_services(config: StackConfig) -> list[ServiceSpec]:
    """Every service process, in start order (registry, detector, orchestrator, notifier, dashboard, then agents)."""
    services = _platform_services(config)
    agent_settings = {
        "REPRISE_GPU_BACKEND": "sim",
        "REPRISE_GPU_COUNT": str(config.gpus_per_node),
        "REPRISE_ADVERTISE_ADDR": config.host,
        "REPRISE_STANDBYS": str(config.standbys),
    }
    if config.runtime == "docker":
        agent_settings["REPRISE_DOCKER_URL"] = config.docker_url
        agent_settings["REPRISE_CONTAINER_MOUNT_ROOTS"] = json.dumps([str(p) for p in container_mount_roots(config)])
    if config.scheduler == "slurm":
        orchestrator = next(spec for spec in services if spec.role == "orchestrator")
        orchestrator.env.update(slurm_orchestrator_env(config, agent_settings))
        return services
    if config.scheduler == "kubernetes":  # the API server's address and CA are added once it runs (kube_cluster.py)
        orchestrator = next(spec for spec in services if spec.role == "orchestrator")
        orchestrator.env.update(kubernetes_orchestrator_env(config, agent_settings))
        return services
    return services + _agent_services(config, agent_settings)


def _base_env(config: StackConfig, role: str, port: int, identity: str | None = None) -> dict[str, str]:
    """What every process of the stack is told: NATS and its own identity there, its HTTP address, its state dir."""
    return {
        "REPRISE_NATS_URL": config.nats_url,
        # Its own NATS identity (`reprise creds`): a service's is named after it, an agent's after its node.
        "REPRISE_NATS_NKEY_SEED_FILE": str(seed_file(config.creds_dir.resolve(), identity or role)),
        "REPRISE_HTTP_HOST": config.host,
        "REPRISE_HTTP_PORT": str(port),
        "REPRISE_STATE_DIR": str(config.state_dir.resolve() / role),
        "REPRISE_LOG_FORMAT": "json",
    }


def _service(config: StackConfig, role: str, env: dict[str, str]) -> ServiceSpec:
    """A platform service named after its role, on its own port, with `env` beside what every process is told."""
    port = config.ports[role]
    return ServiceSpec(role, role, ROLE_COMMANDS[role], {**_base_env(config, role, port), **env}, port)


def _platform_services(config: StackConfig) -> list[ServiceSpec]:
    """The platform's services, in start order: registry, detector, orchestrator, notifier, dashboard."""
    state, ports = config.state_dir.resolve(), config.ports
    registry_url = config.http_url(ports["checkpoint-registry"])
    return [
        _service(config, "checkpoint-registry", {"REPRISE_DATABASE_URL": f"sqlite:///{state / 'registry.db'}"}),
        _service(config, "detector", {
            "REPRISE_DATABASE_URL": f"sqlite:///{state / 'detector.db'}",
            "REPRISE_NODE_KEYS_FILE": str(node_keys_file(config.creds_dir.resolve())),  # closed connections, at once
        }),
        _service(config, "orchestrator", {
            "REPRISE_DATABASE_URL": f"sqlite:///{state / 'orchestrator.db'}",
            "REPRISE_REDIS_URL": config.redis_url,
            "REPRISE_REDIS_USERNAME": REDIS_USER,  # the ACL user that reaches only reprise:* keys
            "REPRISE_REDIS_PASSWORD": ensure_redis_password(config.state_dir),
            "REPRISE_REGISTRY_URL": registry_url,
            "REPRISE_ADMIN_API_KEY": ensure_admin_api_key(config.state_dir),  # created once in the state dir
            "REPRISE_READ_API_KEY": ensure_read_api_key(config.state_dir),  # the dashboard's and viewers'
        }),
        _service(config, "notifier", {
            "REPRISE_DATABASE_URL": f"sqlite:///{state / 'notifier.db'}",
            "REPRISE_NOTIFIER_SLACK_URL": slack_receiver_url(config) + SLACK_RECEIVER_WEBHOOK,
            "REPRISE_DASHBOARD_URL": config.http_url(ports["dashboard"]),  # alerts link to its incident pages
        }),
        _service(config, "dashboard", {
            "REPRISE_ORCHESTRATOR_URL": config.http_url(ports["orchestrator"]),
            "REPRISE_DETECTOR_URL": config.http_url(ports["detector"]),
            "REPRISE_REGISTRY_URL": registry_url,
            "REPRISE_NOTIFIER_URL": config.http_url(ports["notifier"]),
            # The dashboard only reads: it gets the read key (viewers sign in with it too, or a key of their own).
            "REPRISE_READ_API_KEY": ensure_read_api_key(config.state_dir),
        }),
    ]  # fmt: skip


def _agent_services(config: StackConfig, agent_settings: dict[str, str]) -> list[ServiceSpec]:
    """One agent per node, workers then spares, on consecutive ports from the agents' base port."""
    services = []
    for index, (node_id, spare) in enumerate(node_ids(config)):
        port = config.ports["agent"] + index
        env = {
            **_base_env(config, "agent", port, identity=node_id),
            **agent_settings,
            "REPRISE_STATE_DIR": str(config.state_dir.resolve() / "agents" / node_id),
            "REPRISE_NODE_ID": node_id,
            "REPRISE_SPARE": "true" if spare else "false",
        }
        services.append(ServiceSpec(agent_name(node_id), "agent", ROLE_COMMANDS["agent"], env, port))
    return services


def slurm_orchestrator_env(config: StackConfig, agent_settings: dict[str, str]) -> dict[str, str]:
    """The orchestrator's settings for the local Slurm cluster: its slurm.conf, and how an allocation starts this
    checkout's agent on each node with what `reprise up` gives its own agents (ports from the agents' base port, in
    allocation order; state under state/agents/<node>)."""
    agent_env = {
        **agent_settings,
        "REPRISE_HTTP_HOST": config.host,
        "REPRISE_STATE_DIR": str(config.state_dir.resolve() / "agents"),
    }
    return {
        "REPRISE_COMPUTE_BACKEND": "slurm",
        "REPRISE_SLURM_CONF": str(config.slurm_dir / "slurm.conf"),
        "REPRISE_SLURM_POLL_INTERVAL_S": "1",
        "REPRISE_SLURM_AGENT_COMMAND": str(Path(sys.executable).parent / ROLE_COMMANDS["agent"]),
        "REPRISE_SLURM_AGENT_CREDS_DIR": str(config.creds_dir.resolve()),
        "REPRISE_SLURM_AGENT_HTTP_PORT": str(config.ports["agent"]),
        "REPRISE_SLURM_AGENT_ENV": json.dumps(agent_env),
    }


def kubernetes_orchestrator_env(config: StackConfig, agent_settings: dict[str, str]) -> dict[str, str]:
    """The orchestrator's settings for the local API server (its address, token and CA come with it: KubeCluster):
    the jobs' namespace, the nodes labelled for training, and how a job's pod starts this checkout's agent (any free
    HTTP port: every pod runs on this host's address; state under state/agents/<job>/<node>)."""
    agent_env = {
        # The node's address comes from the pod's status.hostIP, as on a cluster (the kubelet double's: 127.0.0.1).
        **{name: value for name, value in agent_settings.items() if name != "REPRISE_ADVERTISE_ADDR"},
        "REPRISE_HTTP_HOST": config.host,
        "REPRISE_STATE_DIR": str(config.state_dir.resolve() / "agents"),
    }
    return {
        "REPRISE_COMPUTE_BACKEND": "kubernetes",
        "REPRISE_KUBERNETES_JOBS_NAMESPACE": JOBS_NAMESPACE,
        "REPRISE_KUBERNETES_NAMESPACES": json.dumps([JOBS_NAMESPACE]),
        "REPRISE_KUBERNETES_NODE_SELECTOR": NODE_SELECTOR,
        "REPRISE_SLURM_AGENT_COMMAND": str(Path(sys.executable).parent / ROLE_COMMANDS["agent"]),
        "REPRISE_SLURM_AGENT_CREDS_DIR": str(config.creds_dir.resolve()),
        "REPRISE_SLURM_AGENT_HTTP_PORT": "0",
        "REPRISE_SLURM_AGENT_ENV": json.dumps(agent_env),
    }


def rank_runtime_paths() -> list[Path]:
    """What a rank running this checkout's interpreter needs mounted in a container of the base image, read-only:
    the host's Python, the checkout's .venv, the SDK and shared library it imports (installed editable), the
    examples. Not the whole checkout: its state directories may hold a Docker socket."""
    paths = [Path(os.path.realpath(sys.base_prefix)), Path(os.path.realpath(sys.prefix))]
    paths += [CHECKOUT / "sdk", CHECKOUT / "libs", CHECKOUT / "examples"]
    return list(dict.fromkeys(paths))


def container_mount_roots(config: StackConfig) -> list[Path]:
    """What the stack's nodes let a job's containers mount: its jobs directory and the paths a rank runs from."""
    return [config.jobs_dir, *rank_runtime_paths()]


def agent_name(node_id: str) -> str:
    """The name of a node's agent among the stack's services (its log: logs/<name>.log)."""
    return f"agent-{node_id}"


# The local Slack-compatible receiver (cli/reprise_cli/slack_receiver.py) is a stand-in for Slack, not a platform
# service: `reprise up` runs it beside NATS and Redis, and Docker has none (compose's notifier takes a real URL).
SLACK_RECEIVER_WEBHOOK = "/services/reprise/local/notifier"


def slack_receiver_url(config: StackConfig) -> str:
    """Base URL of the local Slack receiver (its messages: /messages, or / in a browser)."""
    return config.http_url(config.ports["slack-receiver"])


def slack_receiver_argv(config: StackConfig, python: str) -> list[str]:
    """The receiver's command line; it records every message it gets in the state dir."""
    log = config.state_dir.resolve() / "slack-receiver.jsonl"
    port = str(config.ports["slack-receiver"])
    return [python, "-m", "reprise_cli.slack_receiver", "--host", config.host, "--port", port, "--log", str(log)]
