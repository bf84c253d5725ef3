"""The processes of a real-stack test: orchestrator replicas, agents (simulated GPUs), registry, detector.

Shared by the stack tests of the orchestrator. Launches are counted at the agents, from the rank log files they write
(one ``started`` line per rank process).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from reprise_cli.redis_server import RedisServer
from reprise_cli.servers import ManagedProcess, NatsServer, PortTaken, answers, free_port, wait_until, with_port_retries
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.events import (
    Culprit,
    Event,
    IncidentChange,
    parse_event,
)

from . import incidents

RANK = """
import os, signal, sys, time
from reprise_sdk import heartbeat
print(f"started rank={os.environ['RANK']} epoch={os.environ['REPRISE_RESTART_EPOCH']} pid={os.getpid()}", flush=True)
def on_term(*_):
    print("sigterm", flush=True)
    time.sleep(float(os.environ.get("LINGER_S", "0")))  # a stop that takes a while: the owner waits for it
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
if int(os.environ["REPRISE_RESTART_EPOCH"]) > 0:  # a relaunched rank restores before its first step
    time.sleep(float(os.environ.get("RESTART_STARTUP_S", "0")))
exit_code = int(os.environ.get("EXIT_CODE", "-1"))
step = 0
while True:
    step += 1
    heartbeat(step)
    if exit_code >= 0 and step >= 5:
        sys.exit(exit_code)
    time.sleep(0.1)
"""


@dataclass
class Cluster:
    """The processes of one test and how to reach them."""

    root: Path
    nats: NatsServer
    redis: RedisServer
    replicas: tuple[str, ...]
    nodes: tuple[str, ...]  # the worker nodes a job is submitted to
    spares: tuple[str, ...] = ()
    lock_ttl_s: float = 3.0
    api_key: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    processes: dict[str, ManagedProcess] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    paused: set[str] = field(default_factory=set)

    def start(self, name: str, module: str, env: dict[str, str]) -> ManagedProcess:
        """Run `python -m module` as `name` on a free port with the shared settings plus `env` (wait_ready moves it
        to another port if that one is taken before it binds it)."""
        self.ports[name] = free_port()
        base = {
            "REPRISE_NATS_URL": self.nats.url,
            "REPRISE_HTTP_HOST": "127.0.0.1",
            "REPRISE_HTTP_PORT": str(self.ports[name]),
            "REPRISE_STATE_DIR": str(self.root / name),
            "REPRISE_LOG_FORMAT": "json",
        }
        process = ManagedProcess(name, [sys.executable, "-m", module], self.root / f"{name}.log", {**base, **env})
        process.start()
        self.processes[name] = process
        return process

    def start_registry_and_agents(self) -> None:
        """The checkpoint registry and one agent per worker and spare node (one simulated GPU each), started."""
        self.start("registry", "reprise_registry", {"REPRISE_DATABASE_URL": f"sqlite:///{self.root / 'reg.db'}"})
        for node in (*self.nodes, *self.spares):
            env = {"REPRISE_NODE_ID": node, "REPRISE_GPU_BACKEND": "sim", "REPRISE_GPU_COUNT": "1",
                   "REPRISE_REPORT_INTERVAL_S": "0.5", "REPRISE_STOP_GRACE_S": "5",
                   "REPRISE_SPARE": str(node in self.spares).lower()}  # fmt: skip
            self.start(node, "reprise_agent", env)

    def url(self, name: str) -> str:
        """Base URL of a process's HTTP side."""
        return f"http://127.0.0.1:{self.ports[name]}"

    def wait_ready(self, *names: str) -> None:
        """Every named process answers /readyz with 200 on its own port; one whose port another process took before
        it bound it is started again on another, which the processes started after this are given."""

        def ready(name: str) -> bool:  # raises once the process ended: PortTaken when it lost its port
            return self.processes[name].listening(self.ports[name]) and answers(self.url(name) + "/readyz", timeout_s=2)

        def wait(name: str) -> None:
            assert wait_until(partial(ready, name), timeout_s=45, interval_s=0.2), self.processes[name].log_tail()

        for name in names:
            with_port_retries(partial(wait, name), before_retry=partial(self._move, name))

    def _move(self, name: str, _taken: PortTaken) -> None:
        """Start a process that lost its port again on another."""
        process = self.processes[name]
        process.stop()
        self.ports[name] = free_port()
        process.env["REPRISE_HTTP_PORT"] = str(self.ports[name])
        process.start()

    def orchestrator(self, replica: str) -> ManagedProcess:
        """Start one replica; all share the database, Redis and the registry."""
        env = {
            "REPRISE_REPLICA_ID": replica,
            "REPRISE_DATABASE_URL": f"sqlite:///{self.root / 'orchestrator.db'}",
            "REPRISE_REDIS_URL": self.redis.url,
            "REPRISE_REGISTRY_URL": self.url("registry"),
            "REPRISE_ADMIN_API_KEY": self.api_key,
            "REPRISE_LOCK_TTL_S": str(self.lock_ttl_s),
            "REPRISE_COMMAND_TIMEOUT_S": "5",
            "REPRISE_STOP_GRACE_S": "5",
        }
        return self.start(replica, "reprise_orchestrator", env)

    def api(self, replica: str | None = None) -> httpx.Client:
        """A REST client of a live replica, with the admin key."""
        name = replica or next(r for r in self.replicas if self.processes[r].alive() and r not in self.paused)
        return httpx.Client(base_url=self.url(name), headers={"Authorization": f"Bearer {self.api_key}"}, timeout=10)

    def fresh_nodes(self, replica: str) -> int:
        """How many nodes the replica's inventory holds as fresh."""
        with self.api(replica) as api:
            return sum(not n["stale"] for n in api.get("/v1/nodes").raise_for_status().json())

    def submit(
        self,
        *,
        env: dict[str, str] | None = None,
        policy: dict[str, Any] | None = None,
        labels: dict[str, str] | None = None,
        nodes: tuple[str, ...] | None = None,
    ) -> dict[str, Any]:
        """Submit a job of one rank on each worker node (or on `nodes`), running the RANK script; it is running when
        this returns."""
        on = nodes or self.nodes
        body = {
            "name": "replicas",
            "nodes": list(on),
            "ranks_per_node": 1,
            "command": [sys.executable, str(self.root / "rank.py")],
            "env": env or {},
            "policy": policy or {},
            "labels": labels or {},
        }
        with self.api() as api:
            response = api.post("/v1/jobs", json=body)
        assert response.status_code == 201, response.text
        job: dict[str, Any] = response.json()
        assert job["state"] == "running", job
        # Running means every agent spawned its rank; a rank stopped before its script starts leaves no line to
        # count (nor a "sigterm"), so faults are injected once every rank says it started.
        started = {node: {0: 1} for node in on}
        assert wait_until(lambda: self.launches(job["id"]) == started, timeout_s=15), self.launches(job["id"])
        return job

    def recoveries(self, job_id: str) -> list[dict[str, Any]]:
        """The job's recoveries, newest first, from a live replica."""
        with self.api() as api:
            return list(api.get(f"/v1/jobs/{job_id}/recoveries").raise_for_status().json()["data"])

    def job(self, job_id: str) -> dict[str, Any]:
        """The job, from a live replica."""
        with self.api() as api:
            body: dict[str, Any] = api.get(f"/v1/jobs/{job_id}").raise_for_status().json()
            return body

    def rank_logs(self, job_id: str, node: str) -> list[Path]:
        """The rank log files the node's agent wrote for the job."""
        return sorted((self.root / node / "ranks" / job_id).glob("epoch-*-rank-*.log"))

    def launches(self, job_id: str) -> dict[str, dict[int, int]]:
        """Rank processes started per node and restart epoch, as the agents' rank logs show them."""
        counts: dict[str, dict[int, int]] = {}
        for node in (*self.nodes, *self.spares):
            for path in self.rank_logs(job_id, node):
                epoch = int(path.name.split("-")[1])
                started = sum(line.startswith("started ") for line in path.read_text().splitlines())
                counts.setdefault(node, {})[epoch] = counts.get(node, {}).get(epoch, 0) + started
        return counts

    def stop_arrived(self, job_id: str, epoch: int) -> bool:
        """Every worker node's rank of `epoch` got its SIGTERM."""
        logs = [p for node in self.nodes for p in self.rank_logs(job_id, node) if p.name.startswith(f"epoch-{epoch}-")]
        return len(logs) == len(self.nodes) and all("sigterm" in p.read_text() for p in logs)

    def log_records(self, name: str) -> list[dict[str, Any]]:
        """A process's JSON log records."""
        records = []
        for line in (self.root / f"{name}.log").read_text(errors="replace").splitlines():
            if line.startswith("{"):
                records.append(json.loads(line))
        return records


async def stored(url: str, subject: str, stream: str) -> list[Event]:
    """Every event stored on a stream under a subject, oldest first."""
    bus = Bus(url=url, service="test-stack", provision=False)
    await bus.connect(attempts=10)
    found: list[Event] = []
    sub = await bus.js.pull_subscribe(subject, stream=stream)
    try:
        while True:
            for msg in await sub.fetch(100, timeout=0.5):
                found.append(parse_event(msg.data))
                await msg.ack()
    except TimeoutError:
        return found
    finally:
        await sub.unsubscribe()
        await bus.close()


def opened(job: dict[str, Any], *, incident_id: str) -> IncidentChange:
    """An opened incident naming rank 0 on its node, as the detector would publish it (each with its own event id)."""
    culprit = job["placement"][0]
    return incidents.incident(
        incident_id=incident_id,
        job_id=job["id"],
        root_cause="rank 0 failed: exit code 1",
        culprit=Culprit(node_id=culprit["node_id"], rank=culprit["rank"]),
    )


async def _publish(url: str, incidents: list[IncidentChange]) -> None:
    bus = Bus(url=url, service="test-stack")
    await bus.connect(attempts=10)
    try:
        await asyncio.gather(*(bus.publish(subjects.incident(i.job_id, "opened"), i) for i in incidents))
    finally:
        await bus.close()


def publish(cluster: Cluster, incidents: list[IncidentChange]) -> None:
    """Publish every incident at once to the INCIDENTS stream."""
    asyncio.run(_publish(cluster.nats.url, incidents))
