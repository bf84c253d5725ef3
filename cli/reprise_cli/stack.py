"""The whole platform on this machine, without Docker: real servers and every service as processes (with
runtime="docker", a dockerd of the stack's own beside them runs the ranks of containerized jobs)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import httpx

from reprise_cli.client import PlatformClient
from reprise_cli.creds import ADMIN, ensure_redis_password, init_credentials, read_admin_api_key, seed_file
from reprise_cli.dockerd import DockerDaemon, docker_unavailable_reason, ensure_base_image
from reprise_cli.kube_cluster import KubeCluster, kube_unavailable_reason
from reprise_cli.ports import PortTaken, free_stack_ports, require_free_port, with_port_retries
from reprise_cli.redis_server import RedisServer, find_redis_server
from reprise_cli.servers import ManagedProcess, NatsServer, answers, deploy_dir, find_nats_server, wait_until
from reprise_cli.slurm import SlurmCluster, slurm_unavailable_reason
from reprise_cli.supervise import RestartPolicy, Supervisor
from reprise_cli.topology import (
    DEFAULT_PORTS,
    ServiceSpec,
    StackConfig,
    agent_name,
    build_services,
    node_ids,
    slack_receiver_argv,
    slack_receiver_url,
)
from reprise_common.errors import ConfigError

_PORT_FLAGS = {
    "nats": "--nats-port",
    "nats-monitor": "--nats-monitor-port",
    "redis": "--redis-port",
    "checkpoint-registry": "--registry-port",
    "detector": "--detector-port",
    "orchestrator": "--orchestrator-port",
    "notifier": "--notifier-port",
    "slack-receiver": "--slack-receiver-port",
    "dashboard": "--dashboard-port",
    "agent": "--agent-port",
}


def _command_path(command: str) -> str:
    path = Path(sys.executable).parent / command
    if not path.exists():
        raise ConfigError(f"{command} is not installed beside {sys.executable}: run `make venv`")
    return str(path)


@dataclass
class Stack:
    """Starts NATS, Redis and every service and supervises them (a crash is restarted); stops all of them, leaving
    no process behind."""

    config: StackConfig
    say: Callable[[str], None] = print
    # Tests and benchmarks: run on ports chosen free at start, not the config's, and choose them again when another
    # process takes one before its server binds it (`reprise up` runs on the ports the user asked for).
    free_ports: bool = False
    restart_policy: RestartPolicy = field(default_factory=RestartPolicy)
    nats: NatsServer | None = None
    redis: RedisServer | None = None
    slack_receiver: ManagedProcess | None = None
    services: dict[str, ManagedProcess] = field(default_factory=dict)
    specs: list[ServiceSpec] = field(default_factory=list)
    slurm: SlurmCluster | None = None  # scheduler="slurm": the local cluster the jobs run on
    kube: KubeCluster | None = None  # scheduler="kubernetes": the API server and kubelet double the jobs run on
    docker: DockerDaemon | None = None  # runtime="docker": the daemon the agents start containers with
    container_image: str | None = None  # runtime="docker": the base image in it (reprise/base:<suite>-<hash>)
    supervisor: Supervisor = field(init=False)
    _agent_ports: dict[str, int] = field(default_factory=dict)  # on Slurm: each node's agent, as found

    def __post_init__(self) -> None:
        self.supervisor = Supervisor(say=self.say, log_path=self.log_dir / "supervisor.log", policy=self.restart_policy)

    @property
    def log_dir(self) -> Path:
        """Where every process writes its output."""
        return self.config.state_dir / "logs"

    def preflight(self) -> None:
        """Fail fast on a missing binary (one line naming the fix) or a taken port (PortTaken)."""
        find_nats_server()
        find_redis_server()
        if self.config.scheduler == "slurm" and (reason := slurm_unavailable_reason()) is not None:
            raise ConfigError(f"{reason} (`make slurm-deps` installs it, as root)")
        if self.config.scheduler == "kubernetes" and (reason := kube_unavailable_reason()) is not None:
            raise ConfigError(f"no kube-apiserver: {reason} (`make kube-deps` builds it, as root)")
        if self.config.runtime == "docker":
            if self.config.scheduler != "agents":
                raise ConfigError(f"ranks in containers run on the built-in agents, not yet on {self.config.scheduler}")
            if (reason := docker_unavailable_reason()) is not None:
                raise ConfigError(f"{reason} (`make docker-deps` installs it, as root)")
        self.specs = build_services(self.config)
        for spec in self.specs:
            _command_path(spec.command)
        for key in ("nats", "nats-monitor", "redis", "slack-receiver"):
            require_free_port(self.config.ports[key], key)
        for spec in self.specs:
            require_free_port(spec.http_port, spec.name)

    def start(self, *, timeout_s: float = 30.0) -> None:
        """Start everything and wait until every service reports ready; a port another process has is an error naming
        the flag that moves it. With free_ports, every try chooses its ports (`config` then holds the ones the stack
        runs on) and one that lost a port is stopped and followed by another, at most PORT_ATTEMPTS in all."""
        if self.free_ports:
            with_port_retries(partial(self._start_on_free_ports, timeout_s), before_retry=self._stop_after)
            return
        try:
            self._start(timeout_s)
        except PortTaken as taken:
            raise ConfigError(f"{taken}: stop what uses it or pass {self._flag(taken.port)} <other port>") from taken

    def _stop_after(self, taken: PortTaken) -> None:
        """Stop what a try that lost a port left running (the next one chooses other ports)."""
        self.say(f"{taken}: starting again on other ports")
        self.stop()

    def _start_on_free_ports(self, timeout_s: float) -> None:
        ports = free_stack_ports(DEFAULT_PORTS, agents=len(node_ids(self.config)))
        self.config = replace(self.config, ports=ports)
        self._start(timeout_s)

    def _flag(self, port: int) -> str:
        """The `reprise up` flag that moves a port (an agent's: the base of the agents' run)."""
        return _PORT_FLAGS[next((key for key, value in self.config.ports.items() if value == port), "agent")]

    def _start(self, timeout_s: float) -> None:
        """Start the servers, the Slack receiver and every service on the config's ports; PortTaken when one of them
        lost its port."""
        self.preflight()
        state = self.config.state_dir
        state.mkdir(parents=True, exist_ok=True)
        init_credentials(
            self.config.creds_dir,
            nodes=[node for node, _spare in node_ids(self.config)],
            base_config=deploy_dir() / "nats" / "nats.conf",
        )
        self.nats = NatsServer(
            port=self.config.ports["nats"],
            monitor_port=self.config.ports["nats-monitor"],
            store_dir=state / "nats",
            log_path=self.log_dir / "nats.log",
            host=self.config.host,
            config=self.config.creds_dir / "nats.conf",
        )
        self.redis = RedisServer(
            port=self.config.ports["redis"],
            data_dir=state / "redis",
            log_path=self.log_dir / "redis.log",
            host=self.config.host,  # where the orchestrator looks for it (config.redis_url)
            password=ensure_redis_password(self.config.state_dir),
        )
        self.nats.start()
        self.redis.start()
        if self.config.scheduler == "slurm":  # before the orchestrator, which reads its slurm.conf at start
            self.slurm = SlurmCluster.start_on_free_ports(
                self.config.slurm_dir, nodes=self.config.nodes + self.config.spares, timeout_s=60
            )
        if self.config.scheduler == "kubernetes":  # before the orchestrator, which watches its nodes from the start
            self._start_kube()
        self._start_slack_receiver()
        if self.config.runtime == "docker":  # before the agents, which connect to it at their first container job
            self._start_docker()
        for spec in self.specs:
            process = ManagedProcess(
                spec.name, [_command_path(spec.command)], self.log_dir / f"{spec.name}.log", spec.env
            )
            process.start()
            self.services[spec.name] = process
        self.wait_ready(timeout_s=timeout_s)
        self._supervise()

    def _supervise(self) -> None:
        """From now on a server or service that crashes is restarted (a failed start above is not retried)."""
        assert self.nats is not None and self.redis is not None and self.slack_receiver is not None
        self.supervisor.watch("nats", self.nats)
        self.supervisor.watch("redis", self.redis)
        self.supervisor.watch("slack-receiver", self.slack_receiver)
        for name, process in self.services.items():
            self.supervisor.watch(name, process)
        self.supervisor.start()

    def _start_slack_receiver(self) -> None:
        """Start the local stand-in for Slack (the notifier's default destination) and wait until it answers."""
        argv = slack_receiver_argv(self.config, sys.executable)
        self.slack_receiver = ManagedProcess("slack-receiver", argv, self.log_dir / "slack-receiver.log")
        self.slack_receiver.start()
        receiver, port = self.slack_receiver, self.config.ports["slack-receiver"]
        health = slack_receiver_url(self.config) + "/healthz"
        if not wait_until(lambda: receiver.listening(port) and answers(health), timeout_s=15):
            raise ConfigError(f"the Slack receiver did not start: {receiver.log_tail(5)}")

    def _start_docker(self) -> None:
        """Start the stack's dockerd and import the ranks' base image into it (built once per machine, cached)."""
        self.docker = DockerDaemon(self.config.docker_dir)
        self.docker.start()
        self.say(f"dockerd of the stack's own ready ({self.config.docker_url})")
        self.container_image = ensure_base_image(self.docker.url)

    def _start_kube(self) -> None:
        """Start the API server, set the cluster up and start its kubelet double; tell the orchestrator where it is."""
        self.kube = KubeCluster(self.config.kube_dir, node_ids(self.config), logs=self.log_dir / "pods")
        self.kube.start()
        orchestrator = next(spec for spec in self.specs if spec.role == "orchestrator")
        orchestrator.env.update(self.kube.orchestrator_env())
        url = self.kube.orchestrator_env()["REPRISE_KUBERNETES_API_URL"]
        self.say(f"Kubernetes API server ready ({url}; kubectl --kubeconfig {self.kube.kubeconfig})")

    def hold_node_down(self, node_id: str) -> None:
        """The node's agent stays down once it exits (a simulated node loss): the supervisor does not restart it."""
        self.supervisor.hold(agent_name(node_id))

    def lose_node(self, node_id: str) -> None:
        """The node is lost from now on: its agent, once it exits, is not brought back; on Slurm its slurmd is killed
        too (Slurm finds out by itself, when the node stops answering); on Kubernetes its kubelet double ends the
        node's pods' processes and marks the Node NotReady."""
        if self.slurm is not None:
            self.slurm.kill_node(node_id)
        elif self.kube is not None:
            self.kube.lose_node(node_id)
        else:
            self.hold_node_down(node_id)

    def agent_url(self, node_id: str) -> str:
        """Base URL of the agent of node `node_id`. On Slurm the agents of an allocation take the agents' base port
        plus their index in it: the one on `node_id` is found by asking each of those ports whose it is. On Kubernetes
        the agent of the pod on the node listens on any free port, found from its process."""
        if self.kube is not None:
            return self.kube.agent_url(node_id, self.config.host)
        if self.slurm is None:
            return self.url(agent_name(node_id))
        if node_id not in self._agent_ports:
            base = self.config.ports["agent"]
            for port in range(base, base + len(self.slurm.node_names)):
                try:
                    found = httpx.get(self.config.http_url(port) + "/v1/status", timeout=1.0).json()["node_id"]
                except (httpx.HTTPError, ValueError, KeyError, TypeError):
                    continue
                self._agent_ports[str(found)] = port
        if node_id not in self._agent_ports:
            raise ConfigError(f"no agent of node {node_id} answers on the agents' ports")
        return self.config.http_url(self._agent_ports[node_id])

    def release_node(self, node_id: str) -> None:
        """A node held down is repaired: its agent is started again (by the supervisor) and supervised as before."""
        self.supervisor.release(agent_name(node_id))

    @property
    def admin_seed(self) -> Path:
        """The NATS identity operators and tools use against this stack: every subject; no service has it."""
        return seed_file(self.config.creds_dir, ADMIN)

    def url(self, name: str) -> str:
        """Base URL of a service by name."""
        spec = next(s for s in self.specs if s.name == name)
        return self.config.http_url(spec.http_port)

    def client(self) -> PlatformClient:
        """A client of this stack's public interfaces, with its NATS identity and admin API key (close it after)."""
        return PlatformClient(
            orchestrator=self.url("orchestrator"),
            detector=self.url("detector"),
            registry=self.url("checkpoint-registry"),
            nats_url=self.config.nats_url,
            nkey_seed_file=self.admin_seed,
            api_key=read_admin_api_key(self.config.state_dir),
        )

    def wait_ready(self, *, timeout_s: float) -> None:
        """Poll every /readyz until all answer 200; a service that dies or stays unready is named with its log."""
        pending = {spec.name for spec in self.specs}
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=1.0) as client:
            while pending and time.monotonic() < deadline:
                for spec in [spec for spec in self.specs if spec.name in pending]:
                    if not self.services[spec.name].listening(spec.http_port):  # raises once it ended
                        continue
                    try:
                        if client.get(self.url(spec.name) + "/readyz").status_code == 200:
                            pending.discard(spec.name)
                    except httpx.HTTPError:
                        pass
                time.sleep(0.1)
        if pending:
            raise ConfigError(
                f"not ready after {timeout_s:.0f}s: {', '.join(sorted(pending))} (logs in {self.log_dir})"
            )

    def stop(self) -> None:
        """Stop the supervisor (nothing restarts from here on), the services (agents first, so ranks stop cleanly),
        the Slurm or Kubernetes cluster, then the Slack receiver, Redis, NATS and the dockerd."""
        self.supervisor.stop()
        for name in reversed(list(self.services)):
            self.services[name].stop(grace_s=15.0)
        if self.slurm is not None:  # its jobs cancelled: their agents stop their ranks
            self.slurm.stop()
        if self.kube is not None:  # the pods' agents stop their ranks, then the API server and etcd stop
            self.kube.stop()
        if self.slack_receiver is not None:
            self.slack_receiver.stop(grace_s=5.0)
        if self.redis is not None:
            self.redis.stop()
        if self.nats is not None:
            self.nats.stop()
        if self.docker is not None:  # after the agents: a containerized rank left over dies with the daemon
            self.docker.stop()
            self.docker = None

    def pids(self) -> list[int]:
        """Every process the stack started."""
        processes = [*self.services.values(), *([self.slack_receiver] if self.slack_receiver else [])]
        processes += [s.process for s in (self.nats, self.redis) if s is not None and s.process is not None]
        processes += [self.docker.process] if self.docker is not None and self.docker.process is not None else []
        kube = self.kube.pids() if self.kube is not None else []  # its pods' processes end with its kubelet double
        return [p.pid for p in processes if p.proc is not None] + kube
