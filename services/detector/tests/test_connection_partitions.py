"""What the NATS server does to an agent's connection is no node loss when the agent is alive: the server closing it as
a stale connection (the agent's pings missed for a while), and the agent's member of a NATS cluster killed (its agents
move to another member). Real secured nats-servers, real agent-like processes reporting with their nodes' identities."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from reprise_cli.creds import Credentials, init_credentials
from reprise_cli.servers import NatsCluster, NatsServer, deploy_dir

from .conftest import Harness, wait_until
from .test_connection_loss import NODES, Agents, detector_on

PINGS = 'ping_interval: "1s"\nping_max: 1\n'  # the server closes a client's connection after ~2 s without an answer


async def _known(h: Harness) -> bool:
    return all(node in h.runtime.watcher.liveness.nodes for node in NODES)


async def _reported_since(h: Harness, since: float, *nodes: str) -> bool:
    return all(h.runtime.watcher.liveness.nodes[node].last_seen > since for node in nodes)


@pytest.fixture
def pinging_creds(tmp_path: Path) -> Credentials:
    base = tmp_path / "nats-pings.conf"
    base.write_text((deploy_dir() / "nats" / "nats.conf").read_text() + PINGS)
    return init_credentials(tmp_path / "creds", nodes=list(NODES), base_config=base)


@pytest.fixture
def pinging(pinging_creds: Credentials, tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer.start_on_free_ports(tmp_path / "nats", config=pinging_creds.server_config)
    yield server
    server.stop()


async def test_a_connection_the_server_closed_as_stale_is_no_loss_when_the_agent_comes_back(
    pinging: NatsServer, pinging_creds: Credentials, sqlite_url: str
) -> None:
    """Found from outside: `Stale Connection` read as a closed connection made the node lost 0.3 s later, though the
    agent was only slow to answer (a paused process, a congested link) and came back within the report limit."""
    agents = Agents(pinging, pinging_creds)
    async with AsyncExitStack() as stack:
        stack.callback(agents.stop_all)
        h = await detector_on(pinging.url, pinging_creds, sqlite_url, stack)
        await h.place("job-a", [(0, "node-2", 0)])
        for node in NODES:
            agents.start(node)
        assert await wait_until(lambda: _known(h))
        agents.signal("node-2", signal.SIGSTOP)  # no pong: the server closes it as stale after about 2 s
        await asyncio.sleep(3.5)
        agents.signal("node-2", signal.SIGCONT)  # it reconnects and reports again, within the 5 s limit
        resumed = time.monotonic()
        assert await wait_until(lambda: _reported_since(h, resumed, "node-2"))
        await asyncio.sleep(2.0)
        assert await h.open_incidents("job-a") == []


@pytest.fixture
def cluster_creds(tmp_path: Path) -> Credentials:
    return init_credentials(tmp_path / "creds", nodes=list(NODES), base_config=deploy_dir() / "nats" / "nats.conf")


@pytest.fixture
def cluster(cluster_creds: Credentials, tmp_path: Path) -> Iterator[NatsCluster]:
    started = NatsCluster.start_on_free_ports(tmp_path / "cluster", config=cluster_creds.server_config)
    yield started
    started.stop()


async def test_the_agents_cluster_member_killed_loses_no_node(
    cluster: NatsCluster, cluster_creds: Credentials, sqlite_url: str
) -> None:
    """Every agent on one member of a 3-server NATS cluster, the member SIGKILLed: the agents move to another member
    (learnt from the cluster's gossip) and report again; no node is lost, nothing is recovered."""
    first, *others = cluster.servers
    agents = Agents(first, cluster_creds)  # each agent is given the first member alone: it learns the others
    async with AsyncExitStack() as stack:
        stack.callback(agents.stop_all)
        h = await detector_on(",".join(s.url for s in others), cluster_creds, sqlite_url, stack)
        await h.place("job-a", [(0, "node-1", 0), (1, "node-2", 0)])
        await h.place("job-b", [(0, "node-2", 0)])
        for node in NODES:
            agents.start(node)
        assert await wait_until(lambda: _known(h), timeout=20)
        assert first.process is not None
        first.process.signal(signal.SIGKILL)
        killed = time.monotonic()
        liveness = h.runtime.watcher.liveness
        back = await wait_until(lambda: _reported_since(h, killed + 0.5, *NODES), timeout=15)
        assert back, "the agents did not report again through another member"
        print(f"every agent reporting again {max(liveness.nodes[n].last_seen for n in NODES) - killed:.2f} s after")
        await asyncio.sleep(2.0)
        assert await h.open_incidents() == []
