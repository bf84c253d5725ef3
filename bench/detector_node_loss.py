"""The detector benchmark's node-loss part: real agent processes killed, restarted gracefully, and nats-server
restarted, on a nats-server with the stack's credentials (accounts, the server's client advisories).

One round per case, each on a job placed afresh (one rank on one node), the detector app in this process with its own
identity and the node keys, the agents real ``reprise-agent`` processes (simulated GPUs, their own identities):

  agent_killed_to_incident   SIGKILL of an agent → the job's `opened` change received (median, p99, each; target
                             median ≤ 1 s); the agent is started again afterwards, as a rebooted node's would be
  graceful_restarts          SIGTERM of an agent (it says it is stopping) and a new agent on the node: incidents
                             opened for their jobs (0 expected, so 0 recoveries)
  nats_restarts              nats-server stopped and started (every connection drops and comes back): incidents
                             opened for the jobs placed on every node (0 expected)
  second_connection_closes   a second client with a node's identity connects, publishes and disconnects while the
                             node's own agent stays connected and reporting: incidents opened (0 expected)

Every part waits SETTLE_S after its last round before it counts, longer than the reconnect grace. The report limit
(REPRISE_NODE_LOST_AFTER_S) stays at its default (5 s): a restart that took longer would count as a loss.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from reprise_cli.creds import Credentials, init_credentials
from reprise_cli.servers import ManagedProcess, NatsServer, deploy_dir, free_port
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.events import IncidentChange, JobPlacement, RankAssignment, parse_event
from reprise_detector.app import create_app
from reprise_detector.runtime import Runtime
from reprise_detector.settings import DetectorSettings

SETTLE_S = 3.0
INCIDENT_TIMEOUT_S = 20.0
KNOWN_TIMEOUT_S = 30.0


def _summary(samples: list[float]) -> dict[str, Any]:
    ordered = sorted(samples)
    return {
        "count": len(ordered),
        "median_ms": round(statistics.median(ordered) * 1000, 1) if ordered else None,
        "p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000, 1) if ordered else None,
        "max_ms": round(ordered[-1] * 1000, 1) if ordered else None,
    }


class NodeLossStack:
    """A secured nats-server, the detector app, an admin bus (placements, incident changes) and agent processes."""

    def __init__(self, root: Path, nodes: int) -> None:
        self.root = root
        self.nodes = [f"node-{index}" for index in range(1, nodes + 1)]
        self.creds: Credentials = init_credentials(
            root / "creds", nodes=self.nodes, base_config=deploy_dir() / "nats" / "nats.conf"
        )
        self.nats = NatsServer.on_free_ports(root / "nats", config=self.creds.server_config)
        self.exit = AsyncExitStack()
        self.admin = Bus(url=self.nats.url, service="bench-admin", nkey_seed_file=self.creds.admin.seed_file)
        self.runtime: Runtime | None = None
        self.agents: dict[str, ManagedProcess] = {}
        self.opened: dict[str, float] = {}  # job → when its incident's `opened` change arrived (wall clock)
        self.placed = 0

    async def start(self) -> None:
        self.nats.start()
        settings = DetectorSettings(
            nats_url=self.nats.url,
            nats_nkey_seed_file=self.creds.services["detector"].seed_file,
            node_keys_file=self.creds.node_keys,
            database_url=f"sqlite:///{self.root / 'detector.db'}",
            log_level="WARNING",
        )
        app = create_app(settings)
        await self.exit.enter_async_context(app.router.lifespan_context(app))
        self.runtime = app.state.runtime
        assert self.runtime is not None
        await self.runtime.wait_started(timeout=30)
        await self.admin.connect(attempts=20)
        await self.admin.nc.subscribe(subjects.INCIDENTS_ALL, cb=self._on_incident)
        for node in self.nodes:
            self.start_agent(node)
        await self.until_known(self.nodes)

    async def stop(self) -> None:
        for agent in self.agents.values():
            agent.stop(grace_s=5)
        await self.admin.close()
        await self.exit.aclose()
        self.nats.stop()

    async def _on_incident(self, msg: Any) -> None:
        change = parse_event(msg.data)
        if isinstance(change, IncidentChange) and change.change == "opened":
            self.opened.setdefault(change.job_id, time.time())

    def start_agent(self, node: str) -> None:
        """A real agent for the node, with its identity (started on this thread: it dies with its parent)."""
        agent = self.agents.get(node)
        if agent is None:
            env = {
                "REPRISE_NODE_ID": node,
                "REPRISE_NATS_URL": self.nats.url,
                "REPRISE_NATS_NKEY_SEED_FILE": str(self.creds.agents[node].seed_file),
                "REPRISE_STATE_DIR": str(self.root / "agents" / node),
                "REPRISE_HTTP_PORT": str(free_port()),
                "REPRISE_GPU_BACKEND": "sim",
                "REPRISE_GPU_COUNT": "1",
                "REPRISE_LOG_LEVEL": "WARNING",
            }
            argv = [sys.executable, "-m", "reprise_agent"]
            agent = self.agents[node] = ManagedProcess(f"agent-{node}", argv, self.root / "logs" / f"{node}.log", env)
        agent.start()

    async def until_known(self, nodes: list[str], *, since: float | None = None) -> None:
        """Wait until the detector has a report from each node (after `since`, its monotonic clock)."""
        assert self.runtime is not None
        liveness = self.runtime.watcher.liveness
        deadline = time.monotonic() + KNOWN_TIMEOUT_S
        while time.monotonic() < deadline:
            seen = [liveness.nodes.get(n) for n in nodes]
            if all(s is not None and (since is None or s.last_seen > since) for s in seen):
                return
            await asyncio.sleep(0.05)
        raise RuntimeError(f"no report from all of {nodes} within {KNOWN_TIMEOUT_S} s")

    async def place(self, node: str) -> str:
        """A fresh job with one rank on the node; its id."""
        assert self.runtime is not None
        self.placed += 1
        job_id = f"job-{self.placed}"
        ranks = [RankAssignment(rank=0, node_id=node, gpu=0, local_rank=0)]
        placement = JobPlacement(source="bench", job_id=job_id, restart_epoch=0, world_size=1, ranks=ranks)
        seq = await self.admin.publish(subjects.placement(job_id), placement)
        assert await self.runtime.placements.wait_for_seq(seq, timeout=30)
        return job_id


async def _killed(stack: NodeLossStack, kills: int) -> dict[str, Any]:
    samples: list[float] = []
    missed = 0
    for index in range(kills):
        node = stack.nodes[index % len(stack.nodes)]
        await stack.until_known([node], since=time.monotonic())
        job_id = await stack.place(node)
        killed_at = time.time()
        stack.agents[node].signal(9)
        deadline = time.monotonic() + INCIDENT_TIMEOUT_S
        while job_id not in stack.opened and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        if job_id in stack.opened:
            samples.append(stack.opened[job_id] - killed_at)
        else:
            missed += 1
        stack.agents[node].proc.wait(timeout=10)  # type: ignore[union-attr]
        stack.start_agent(node)  # the node comes back, as after a reboot
    return _summary(samples) | {"missed": missed, "each_s": [round(s, 3) for s in samples]}


async def _graceful(stack: NodeLossStack, restarts: int) -> dict[str, Any]:
    jobs = []
    for index in range(restarts):
        node = stack.nodes[index % len(stack.nodes)]
        await stack.until_known([node], since=time.monotonic())
        jobs.append(await stack.place(node))
        stack.agents[node].stop(grace_s=10)  # SIGTERM: the agent says it is stopping, then closes
        stack.start_agent(node)
    await stack.until_known(stack.nodes, since=time.monotonic())
    await asyncio.sleep(SETTLE_S)
    return {"restarts": restarts, "incidents_opened": sum(job in stack.opened for job in jobs)}


async def _nats_restarts(stack: NodeLossStack, restarts: int) -> dict[str, Any]:
    jobs = [await stack.place(node) for node in stack.nodes]
    took: list[float] = []
    for _ in range(restarts):
        began = time.monotonic()
        stack.nats.stop()
        stack.nats.start()
        await stack.until_known(stack.nodes, since=time.monotonic())  # every agent reports again
        took.append(time.monotonic() - began)
    await asyncio.sleep(SETTLE_S)
    return {
        "restarts": restarts,
        "jobs_watched": len(jobs),
        "incidents_opened": sum(job in stack.opened for job in jobs),
        "restart_to_all_reporting_s_median": round(statistics.median(took), 2),
    }


async def _second_connections(stack: NodeLossStack, closes: int) -> dict[str, Any]:
    jobs = []
    for index in range(closes):
        node = stack.nodes[index % len(stack.nodes)]
        await stack.until_known([node], since=time.monotonic())
        jobs.append(await stack.place(node))
        other = Bus(
            url=stack.nats.url,
            service=f"not-the-agent-{index}",
            nkey_seed_file=stack.creds.agents[node].seed_file,
            inbox_prefix=subjects.inbox_prefix(node),
            provision=False,
        )
        await other.connect(attempts=20)
        await other.nc.publish(subjects.node_event(node, "agent.lifecycle"), b"{}")
        await other.nc.flush()
        await other.close()
    await asyncio.sleep(SETTLE_S)
    return {"closes": closes, "incidents_opened": sum(job in stack.opened for job in jobs)}


async def node_loss(root: Path, *, nodes: int, kills: int, restarts: int) -> dict[str, Any]:
    """The node-loss part's figures."""
    stack = NodeLossStack(root, nodes)
    await stack.start()
    try:
        killed = await _killed(stack, kills)
        print("agent killed → incident", killed, flush=True)
        graceful = await _graceful(stack, restarts)
        print("graceful agent restarts", graceful, flush=True)
        nats = await _nats_restarts(stack, restarts)
        print("nats-server restarts", nats, flush=True)
        second = await _second_connections(stack, restarts)
        print("second connections closed", second, flush=True)
    finally:
        await stack.stop()
    return {
        "nodes": nodes,
        "agent_killed_to_incident": killed,
        "graceful_restarts": graceful,
        "nats_restarts": nats,
        "second_connection_closes": second,
        "reconnect_grace_s": DetectorSettings.model_fields["reconnect_grace_s"].default,
    }
