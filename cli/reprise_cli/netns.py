"""Several hosts on one machine: each node in a network namespace of its own, with a management link (agent to NATS
and the control plane) and a data link (rank to rank), so a test can cut one host's links and heal them.

Each link is a veth pair into a Linux bridge of its own: the management bridge holds the gateway address, where the
platform's servers listen in the root namespace; the data bridge carries only the hosts' ranks (gloo). A cut is an
iptables DROP inside the host's namespace, so the other end sees silence (no reset, no closed connection), as with
a pulled cable or a power loss; `set_link` takes a link down instead. Every name (namespaces, bridges, veths,
subnets) is chosen fresh per network, so parallel and aborted runs do not collide, and `destroy` removes everything
it made. Needs root, iproute2 and iptables (docs/reliability.md, "Partitions on separate hosts").
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import partial
from pathlib import Path

from reprise_cli.servers import ManagedProcess, answers, wait_until
from reprise_cli.stack import Stack
from reprise_cli.topology import ServiceSpec
from reprise_common.errors import ConfigError
from reprise_common.procs import process_alive

PREFIX = "rp"  # every namespace and root-side link this module makes starts with it
OWNER_ALIAS = "reprise-netns-owner="  # the alias of each root-side link: the pid of the process that made it
BRIDGE_NF = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")  # 1: bridged frames cross the root's FORWARD chain
COMMAND_TIMEOUT_S = 10.0
_NAMESPACE = re.compile(rf"^{PREFIX}(\d+)-[0-9a-f]+-")


class Link(StrEnum):
    """A host's two links, named as the host sees them (the same names in every namespace)."""

    MANAGEMENT = "mgmt0"  # the agent's NATS connection and every control-plane call
    DATA = "data0"  # the ranks' collectives and rendezvous (GLOO_SOCKET_IFNAME)


class Direction(StrEnum):
    """Which traffic of a link a cut drops, seen from the host."""

    IN = "in"
    OUT = "out"
    BOTH = "both"


def netns_unavailable_reason() -> str | None:
    """Why namespaced hosts cannot run here (not root, a missing command, namespaces refused), or None."""
    if os.geteuid() != 0:
        return "namespaced hosts need root (ip netns add, veth pairs, iptables)"
    missing = [name for name in ("ip", "iptables") if shutil.which(name) is None]
    if missing:
        return f"{' and '.join(missing)} not found: install iproute2 and iptables (apt-get install iproute2 iptables)"
    probe = f"{PREFIX}{os.getpid()}-0-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        return f"network namespaces refused here: {made.stderr.strip()}"
    ruled = subprocess.run(
        ["ip", "netns", "exec", probe, "iptables", "-S"], capture_output=True, text=True, check=False
    )
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    if ruled.returncode != 0:
        return f"iptables does not work in a namespace here: {ruled.stderr.strip()}"
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one ip/iptables command; ConfigError with its message when it fails and `check`."""
    done = subprocess.run(list(argv), capture_output=True, text=True, check=False, timeout=COMMAND_TIMEOUT_S)
    if check and done.returncode != 0:
        raise ConfigError(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return done


def _subnets_in_use() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network this machine routes or holds an address in (root namespace)."""
    found = []
    for argv in (("ip", "-o", "-4", "addr", "show"), ("ip", "-4", "route", "show", "table", "all")):
        for token in _run(*argv, check=False).stdout.split():
            with contextlib.suppress(ValueError):
                found.append(ipaddress.IPv4Network(token, strict=False))
    return [net for net in found if net.prefixlen > 0]


def free_subnet_pair() -> tuple[ipaddress.IPv4Network, ipaddress.IPv4Network]:
    """Two /24s of 10.0.0.0/8 that nothing here uses: management and data (chosen at random, so runs differ)."""
    used = _subnets_in_use()
    for _ in range(200):
        second, third = 100 + secrets.randbelow(150), 2 * secrets.randbelow(128)
        pair = (
            ipaddress.IPv4Network(f"10.{second}.{third}.0/24"),
            ipaddress.IPv4Network(f"10.{second}.{third + 1}.0/24"),
        )
        if not any(net.overlaps(other) for net in pair for other in used):
            return pair
    raise ConfigError("no free /24 left in 10.100.0.0-10.249.255.0 for namespaced hosts")


@dataclass(frozen=True)
class Host:
    """One namespaced host: its namespace, and its address on each link."""

    name: str
    namespace: str
    management_ip: str
    data_ip: str
    veths: tuple[str, str]  # the root-side ends of its management and data links

    def argv(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host (ip execs it in place: the pid is the command's own)."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def address(self, link: Link) -> str:
        """This host's address on `link`."""
        return self.management_ip if link is Link.MANAGEMENT else self.data_ip


def _rules(link: Link, direction: Direction) -> list[tuple[str, ...]]:
    """The iptables rule specs (chain first) that silently drop `direction` of `link` inside a host."""
    rules: list[tuple[str, ...]] = []
    if direction in (Direction.IN, Direction.BOTH):
        rules.append(("INPUT", "-i", link.value, "-j", "DROP"))
    if direction in (Direction.OUT, Direction.BOTH):
        rules.append(("OUTPUT", "-o", link.value, "-j", "DROP"))
    return rules


@dataclass
class HostNetwork:
    """Namespaced hosts on a management and a data bridge; cut and heal their links; destroy removes it all."""

    token: str
    management: ipaddress.IPv4Network
    data: ipaddress.IPv4Network
    hosts: dict[str, Host] = field(default_factory=dict)
    cuts: dict[str, set[tuple[str, ...]]] = field(default_factory=dict)  # host -> iptables rules in force
    forward_rules: list[tuple[str, ...]] = field(default_factory=list)  # root FORWARD rules we added

    @classmethod
    def create(cls, names: Sequence[str]) -> HostNetwork:
        """A network with one host per name, every link up; what was made is removed again when a step fails."""
        management, data = free_subnet_pair()
        network = cls(secrets.token_hex(3), management, data)
        try:
            network._bridges()
            for index, name in enumerate(names):
                network._add_host(index, name)
        except BaseException:
            network.destroy()
            raise
        return network

    @property
    def owner(self) -> str:
        """The alias and rule comment of this network's root-side objects: who made them (see sweep_abandoned)."""
        return f"{OWNER_ALIAS}{os.getpid()}"

    @property
    def bridges(self) -> tuple[str, str]:
        """The management and data bridges."""
        return f"{PREFIX}m{self.token}", f"{PREFIX}d{self.token}"

    @property
    def gateway(self) -> str:
        """The management bridge's address in the root namespace: where the platform's servers listen."""
        return str(self.management.network_address + 1)

    def _bridges(self) -> None:
        """Both bridges, up, the management one with the gateway address; bridged frames allowed through FORWARD."""
        for bridge in self.bridges:
            _run("ip", "link", "add", bridge, "type", "bridge")
            _run("ip", "link", "set", bridge, "alias", self.owner, "up")
        _run("ip", "addr", "add", f"{self.gateway}/{self.management.prefixlen}", "dev", self.bridges[0])
        if BRIDGE_NF.exists() and BRIDGE_NF.read_text().strip() == "1":  # a host whose FORWARD policy is DROP
            for bridge in self.bridges:
                rule = ("FORWARD", "-i", bridge, "-o", bridge, "-m", "comment", "--comment", self.owner, "-j", "ACCEPT")
                _run("iptables", "-I", *rule)
                self.forward_rules.append(rule)

    def _add_host(self, index: int, name: str) -> None:
        """A namespace with loopback, a management and a data link into the bridges, each with its address."""
        namespace = f"{PREFIX}{os.getpid()}-{self.token}-{name}"
        veths = (f"{PREFIX}{self.token}{index:02d}m", f"{PREFIX}{self.token}{index:02d}d")
        host = Host(
            name=name,
            namespace=namespace,
            management_ip=str(self.management.network_address + 10 + index),
            data_ip=str(self.data.network_address + 10 + index),
            veths=veths,
        )
        _run("ip", "netns", "add", namespace)
        self.hosts[name] = host
        _run("ip", "-n", namespace, "link", "set", "lo", "up")
        for link, veth, bridge, net in zip(Link, veths, self.bridges, (self.management, self.data), strict=True):
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", link.value, "netns", namespace)
            _run("ip", "link", "set", veth, "alias", self.owner, "master", bridge, "up")
            _run("ip", "-n", namespace, "addr", "add", f"{host.address(link)}/{net.prefixlen}", "dev", link.value)
            _run("ip", "-n", namespace, "link", "set", link.value, "up")
        self.cuts[name] = set()

    def exec(self, host: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a command inside a host and wait for it."""
        return _run(*self.hosts[host].argv(argv), check=check)

    def cut(
        self, host: str, *, links: Iterable[Link] = (Link.MANAGEMENT,), direction: Direction = Direction.BOTH
    ) -> None:
        """Silently drop `direction` of each of `links` of `host` (no reset: the other end hears nothing)."""
        for link in links:
            for rule in _rules(link, direction):
                if rule not in self.cuts[host]:
                    self.exec(host, "iptables", "-I", *rule)
                    self.cuts[host].add(rule)

    def heal(self, host: str, *, links: Iterable[Link] = tuple(Link)) -> None:
        """Lift the cuts of `links` of `host` (every link by default) and bring those links up."""
        healed = set(links)
        for rule in sorted(self.cuts[host]):
            if Link(rule[2]) in healed:  # ("INPUT", "-i", link, ...) or ("OUTPUT", "-o", link, ...)
                self.exec(host, "iptables", "-D", *rule)
                self.cuts[host].discard(rule)
        for link in healed:
            self.set_link(host, link, up=True)

    def set_link(self, host: str, link: Link, *, up: bool) -> None:
        """Take a host's link down (the host sees it go: its routes through it fail) or bring it up again."""
        self.exec(host, "ip", "link", "set", link.value, "up" if up else "down")

    def destroy(self) -> None:
        """Kill what still runs in the hosts, remove every namespace, link and rule this network made; never
        raises for something already gone."""
        for host in self.hosts.values():
            pids = _run("ip", "netns", "pids", host.namespace, check=False).stdout.split()
            for pid in pids:  # every process in our namespace was started in it by this test
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _run("ip", "netns", "del", host.namespace, check=False)
            for veth in host.veths:  # gone with the namespace, unless a process kept it alive
                _run("ip", "link", "del", veth, check=False)
        for bridge in self.bridges:
            _run("ip", "link", "del", bridge, check=False)
        for rule in self.forward_rules:
            _run("iptables", "-D", *rule, check=False)
        self.forward_rules.clear()

    def leftovers(self) -> list[str]:
        """What of this network still exists (namespaces, links): empty after destroy."""
        namespaces = _run("ip", "netns", "list", check=False).stdout
        links = _run("ip", "-o", "link", "show", check=False).stdout
        found = [
            h.namespace for h in self.hosts.values() if re.search(rf"^{re.escape(h.namespace)}\b", namespaces, re.M)
        ]
        names = [*self.bridges, *(veth for h in self.hosts.values() for veth in h.veths)]
        return found + [name for name in names if re.search(rf": {re.escape(name)}[@:]", links)]


def sweep_abandoned() -> list[str]:
    """Remove the namespaces, links and FORWARD rules of networks whose maker died without destroying them (an
    aborted run); returns what it removed."""
    removed = []
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split(" ", 1)[0]
        match = _NAMESPACE.match(name)
        if match and not process_alive(int(match.group(1))):
            _run("ip", "netns", "del", name, check=False)
            removed.append(name)
    for line in _run("ip", "-o", "link", "show", check=False).stdout.splitlines():
        alias = re.search(rf"alias {re.escape(OWNER_ALIAS)}(\d+)", line)
        if alias and not process_alive(int(alias.group(1))):
            name = line.split(": ", 2)[1].split("@", 1)[0]
            _run("ip", "link", "del", name, check=False)
            removed.append(name)
    for line in _run("iptables", "-S", "FORWARD", check=False).stdout.splitlines():
        owner = re.search(rf'"?{re.escape(OWNER_ALIAS)}(\d+)"?', line)
        if owner and line.startswith("-A ") and not process_alive(int(owner.group(1))):
            _run("iptables", "-D", *line[3:].replace('"', "").split(), check=False)
            removed.append(line)
    return removed


@dataclass
class NamespacedStack(Stack):
    """`reprise up` with each node's agent, and so its ranks, on a host of `network`: the servers and services stay
    in the root namespace and listen on the network's gateway (config.host), the agents reach NATS over their
    management link and advertise their data address as the rendezvous master (ranks use the data link)."""

    network: HostNetwork | None = None
    agent_specs: list[ServiceSpec] = field(default_factory=list)

    def preflight(self) -> None:
        """The stack's own checks; the agents are kept apart, to start on their hosts once the services run."""
        super().preflight()
        self.agent_specs = [spec for spec in self.specs if spec.role == "agent"]
        self.specs = [spec for spec in self.specs if spec.role != "agent"]

    def start(self, *, timeout_s: float = 30.0) -> None:
        """Start the servers and services, then every agent on its host; wait until every agent is ready."""
        if self.network is None or self.config.host != self.network.gateway:
            raise ConfigError("a NamespacedStack needs its network, and config.host set to the network's gateway")
        super().start(timeout_s=timeout_s)
        for spec in self.agent_specs:
            self.services[spec.name] = self._agent_process(spec)
            self.services[spec.name].start()
        for spec in self.agent_specs:
            ready = self.url(spec.name) + "/readyz"
            if not wait_until(partial(answers, ready), timeout_s=timeout_s, interval_s=0.2):
                raise ConfigError(f"{spec.name} not ready on its host: {self.services[spec.name].log_tail(5)}")
            self.supervisor.watch(spec.name, self.services[spec.name])

    def host_of(self, name: str) -> Host:
        """The host an agent (by its service name) runs on."""
        assert self.network is not None
        spec = next(spec for spec in self.agent_specs if spec.name == name)
        return self.network.hosts[spec.env["REPRISE_NODE_ID"]]

    def _agent_process(self, spec: ServiceSpec) -> ManagedProcess:
        """The agent's process inside its host: HTTP on its management address, rendezvous on its data address."""
        host = self.host_of(spec.name)
        env = {
            **spec.env,
            "REPRISE_HTTP_HOST": host.management_ip,
            "REPRISE_ADVERTISE_ADDR": host.data_ip,
            "GLOO_SOCKET_IFNAME": Link.DATA.value,  # the ranks inherit it: their collectives use the data link
        }
        command = str(Path(sys.executable).parent / spec.command)
        return ManagedProcess(spec.name, host.argv([command]), self.log_dir / f"{spec.name}.log", env)

    def url(self, name: str) -> str:
        """Base URL of a service by name; an agent's is on its host's management address."""
        spec = next((spec for spec in self.agent_specs if spec.name == name), None)
        if spec is None:
            return super().url(name)
        return f"http://{self.host_of(name).management_ip}:{spec.http_port}"
