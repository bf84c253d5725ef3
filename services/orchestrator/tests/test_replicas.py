"""Three orchestrator replicas as processes, with real Redis, NATS, checkpoint registry and agents (simulated GPUs).

Launches are counted at the agents, from the rank log files they write (one ``started`` line per rank process):
a storm of incidents makes one recovery and one launch per node; a replica killed or paused mid-recovery is
replaced, and the paused one changes nothing when it wakes; a non-retryable exit code fails the job.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from reprise_cli.client import poll
from reprise_cli.servers import ManagedProcess, NatsServer, RedisServer, free_port, wait_until
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.clock import utcnow
from reprise_common.events import (
    AgentCommand,
    Category,
    CommandAction,
    CommandReply,
    CommandResult,
    Culprit,
    Event,
    IncidentChange,
    JobPlacement,
    RecommendedAction,
    RecoveryChange,
    Severity,
    new_id,
    parse_event,
)
from reprise_orchestrator.app import INCIDENTS_DURABLE

pytestmark = pytest.mark.stack

REPLICAS = ("orch-0", "orch-1", "orch-2")
NODES = ("node-1", "node-2")
LOCK_TTL_S = 3.0
TERMINAL = ("running", "failed", "held")
RANK = """
import os, signal, sys, time
from reprise_sdk import heartbeat
print(f"started rank={os.environ['RANK']} epoch={os.environ['REPRISE_RESTART_EPOCH']} pid={os.getpid()}", flush=True)
def on_term(*_):
    print("sigterm", flush=True)
    time.sleep(float(os.environ.get("LINGER_S", "0")))  # a stop that takes a while: the owner waits for it
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
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
    api_key: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    processes: dict[str, ManagedProcess] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    paused: set[str] = field(default_factory=set)

    def start(self, name: str, module: str, env: dict[str, str]) -> ManagedProcess:
        """Run `python -m module` as `name` with the shared settings plus `env`."""
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

    def url(self, name: str) -> str:
        """Base URL of a process's HTTP side."""
        return f"http://127.0.0.1:{self.ports[name]}"

    def wait_ready(self, *names: str) -> None:
        """Every named process answers /readyz with 200."""

        def ready(name: str) -> bool:
            if not self.processes[name].alive():
                raise AssertionError(f"{name} exited: {self.processes[name].log_tail(10)}")
            try:
                return httpx.get(self.url(name) + "/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        for name in names:
            assert wait_until(partial(ready, name), timeout_s=45, interval_s=0.2), self.processes[name].log_tail()

    def orchestrator(self, replica: str) -> ManagedProcess:
        """Start one replica; all share the database, Redis and the registry."""
        env = {
            "REPRISE_REPLICA_ID": replica,
            "REPRISE_DATABASE_URL": f"sqlite:///{self.root / 'orchestrator.db'}",
            "REPRISE_REDIS_URL": self.redis.url,
            "REPRISE_REGISTRY_URL": self.url("registry"),
            "REPRISE_ADMIN_API_KEY": self.api_key,
            "REPRISE_LOCK_TTL_S": str(LOCK_TTL_S),
            "REPRISE_COMMAND_TIMEOUT_S": "5",
            "REPRISE_STOP_GRACE_S": "5",
        }
        return self.start(replica, "reprise_orchestrator", env)

    def api(self, replica: str | None = None) -> httpx.Client:
        """A REST client of a live replica, with the admin key."""
        name = replica or next(r for r in REPLICAS if self.processes[r].alive() and r not in self.paused)
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
    ) -> dict[str, Any]:
        """Submit a job of one rank on each node, running the RANK script; it is running when this returns."""
        body = {
            "name": "replicas",
            "node_count": len(NODES),
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
        started = {node: {0: 1} for node in NODES}
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
        for node in NODES:
            for path in self.rank_logs(job_id, node):
                epoch = int(path.name.split("-")[1])
                started = sum(line.startswith("started ") for line in path.read_text().splitlines())
                counts.setdefault(node, {})[epoch] = counts.get(node, {}).get(epoch, 0) + started
        return counts

    def stop_arrived(self, job_id: str, epoch: int) -> bool:
        """Every node's rank of `epoch` got its SIGTERM."""
        logs = [p for node in NODES for p in self.rank_logs(job_id, node) if p.name.startswith(f"epoch-{epoch}-")]
        return len(logs) == len(NODES) and all("sigterm" in p.read_text() for p in logs)

    def log_records(self, name: str) -> list[dict[str, Any]]:
        """A process's JSON log records."""
        records = []
        for line in (self.root / f"{name}.log").read_text(errors="replace").splitlines():
            if line.startswith("{"):
                records.append(json.loads(line))
        return records


@pytest.fixture
def cluster(nats_server: NatsServer, redis_server: RedisServer, tmp_path: Path) -> Iterator[Cluster]:
    """Registry, three orchestrator replicas and two agents, every replica seeing both nodes."""
    (tmp_path / "rank.py").write_text(RANK)
    running = Cluster(root=tmp_path, nats=nats_server, redis=redis_server)
    try:
        running.start("registry", "reprise_registry", {"REPRISE_DATABASE_URL": f"sqlite:///{tmp_path / 'reg.db'}"})
        for node in NODES:
            env = {"REPRISE_NODE_ID": node, "REPRISE_GPU_BACKEND": "sim", "REPRISE_GPU_COUNT": "1",
                   "REPRISE_REPORT_INTERVAL_S": "0.5", "REPRISE_STOP_GRACE_S": "5"}  # fmt: skip
            running.start(node, "reprise_agent", env)
        running.wait_ready("registry")
        running.orchestrator(REPLICAS[0])  # first alone: it creates the tables the others then find
        running.wait_ready(REPLICAS[0])
        for replica in REPLICAS[1:]:
            running.orchestrator(replica)
        running.wait_ready(*REPLICAS[1:], *NODES)
        for replica in REPLICAS:
            assert poll(partial(running.fresh_nodes, replica), lambda n: n == 2, timeout_s=15) == 2, replica
        yield running
    finally:
        for process in reversed(running.processes.values()):
            process.signal(signal.SIGCONT)  # a paused replica cannot stop
            process.stop(grace_s=10)


def opened(job: dict[str, Any], *, incident_id: str) -> IncidentChange:
    """An opened incident naming rank 0 on its node, as the detector would publish it (each with its own event id)."""
    culprit = job["placement"][0]
    return IncidentChange(
        source="detector",
        change="opened",
        incident_id=incident_id,
        job_id=job["id"],
        category=Category.APPLICATION,
        severity=Severity.CRITICAL,
        root_cause="rank 0 failed: exit code 1",
        culprit=Culprit(node_id=culprit["node_id"], rank=culprit["rank"]),
        recommended_action=RecommendedAction.RESTART_JOB,
        first_symptom_at=utcnow(),
    )


async def _publish(url: str, incidents: list[IncidentChange]) -> None:
    bus = Bus(url=url, service="test-replicas")
    await bus.connect(attempts=10)
    try:
        await asyncio.gather(*(bus.publish(subjects.incident(i.job_id, "opened"), i) for i in incidents))
    finally:
        await bus.close()


def publish(cluster: Cluster, incidents: list[IncidentChange]) -> None:
    """Publish every incident at once to the INCIDENTS stream."""
    asyncio.run(_publish(cluster.nats.url, incidents))


async def _command_all(url: str, job_id: str, *, fence: int, command_id: str) -> dict[str, CommandReply]:
    """A stop with the given fence to every node, as a replica would send it; each node's reply."""
    bus = Bus(url=url, service="test-replicas", provision=False)
    await bus.connect(attempts=10)
    try:
        command = AgentCommand(command_id=command_id, job_id=job_id, fence=fence, action=CommandAction.STOP)
        return {node: await bus.request(subjects.node_command(node), command, CommandReply) for node in NODES}
    finally:
        await bus.close()


async def _stored(url: str, subject: str, stream: str) -> list[Event]:
    """Every event stored on a stream under a subject, oldest first."""
    bus = Bus(url=url, service="test-replicas", provision=False)
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


async def _incidents_pending(url: str) -> int:
    bus = Bus(url=url, service="test-replicas", provision=False)
    await bus.connect(attempts=10)
    try:
        info = await bus.js.consumer_info("INCIDENTS", INCIDENTS_DURABLE)
        return int(info.num_pending + info.num_ack_pending)
    finally:
        await bus.close()


def wait_recovery(cluster: Cluster, job_id: str, done: Any, timeout_s: float) -> list[dict[str, Any]]:
    """Poll the job's recoveries until done(recoveries) holds; returns the last answer either way."""
    return poll(lambda: cluster.recoveries(job_id), done, timeout_s=timeout_s, interval_s=0.05)


def one_launch_per_node_and_recovery(cluster: Cluster, job_id: str) -> None:
    """Each node started its rank once at submit (epoch 0) and once for the one recovery (epoch 1), never again."""
    assert cluster.launches(job_id) == {node: {0: 1, 1: 1} for node in NODES}


@pytest.mark.parametrize("distinct", [False, True], ids=["same-incident-id", "distinct-incident-ids"])
def test_a_hundred_opened_incidents_make_one_recovery_and_one_launch_per_node(cluster: Cluster, distinct: bool) -> None:
    job = cluster.submit()
    shared = f"inc-{new_id()[:12]}"
    incidents = [opened(job, incident_id=f"inc-{new_id()[:12]}" if distinct else shared) for _ in range(100)]
    publish(cluster, incidents)

    finished = wait_recovery(cluster, job["id"], lambda r: bool(r) and r[0]["step"] in TERMINAL, timeout_s=40)
    assert finished and finished[0]["step"] == "running", finished[:1]
    assert poll(lambda: asyncio.run(_incidents_pending(cluster.nats.url)), lambda n: n == 0, timeout_s=30) == 0

    recoveries = cluster.recoveries(job["id"])
    assert [r["id"] for r in recoveries] == [finished[0]["id"]], [(r["id"], r["step"]) for r in recoveries]
    one_launch_per_node_and_recovery(cluster, job["id"])


def _owned_recovery_after_stop(cluster: Cluster, job_id: str) -> dict[str, Any]:
    """The recovery once its owner's stop reached every node's rank."""
    recoveries = wait_recovery(cluster, job_id, bool, timeout_s=20)
    assert recoveries, "no recovery started"
    assert wait_until(lambda: cluster.stop_arrived(job_id, 0), timeout_s=15, interval_s=0.02), "no stop arrived"
    return recoveries[0]


def test_b_a_killed_owner_is_replaced_within_the_lease(cluster: Cluster) -> None:
    job = cluster.submit(env={"LINGER_S": "1.5"})
    publish(cluster, [opened(job, incident_id=f"inc-{new_id()[:12]}")])
    recovery = _owned_recovery_after_stop(cluster, job["id"])
    owner = recovery["owner"]

    cluster.processes[owner].signal(signal.SIGKILL)
    killed_at = time.monotonic()
    # Until the kernel has torn it down, poll() still sees it running and the REST client would pick it.
    assert wait_until(lambda: not cluster.processes[owner].alive(), timeout_s=10), f"{owner} survived SIGKILL"
    finished = wait_recovery(
        cluster, job["id"], lambda r: r[0]["step"] in TERMINAL, timeout_s=LOCK_TTL_S + 5
    )  # the spec's bound: another replica finishes it within the lease TTL + 5 s
    print(f"killed {owner}; recovery ended {time.monotonic() - killed_at:.2f}s later as {finished[0]['step']}")

    assert [r["id"] for r in finished] == [recovery["id"]]
    assert finished[0]["step"] == "running", (finished[0]["step"], finished[0]["detail"])
    assert finished[0]["owner"] != owner
    one_launch_per_node_and_recovery(cluster, job["id"])


def _stand_down_evidence(cluster: Cluster, replica: str, fence: int) -> list[str]:
    """What shows the woken replica lost: agents refusing its fence, or it saying it stands down."""
    evidence = [
        f"{node}: {r['msg']} (cmd {r.get('cmd')})"
        for node in NODES
        for r in cluster.log_records(node)
        if r.get("msg") == "stale fence refused" and r.get("fence") == fence
    ]
    evidence += [
        f"{replica}: {r['msg']} {r.get('why', '')}"
        for r in cluster.log_records(replica)
        if "standing down" in r.get("msg", "") or "fenced out" in r.get("msg", "")
    ]
    return evidence


def test_c_a_paused_owner_changes_nothing_when_it_wakes(cluster: Cluster) -> None:
    job = cluster.submit(env={"LINGER_S": "1.5"})
    publish(cluster, [opened(job, incident_id=f"inc-{new_id()[:12]}")])
    recovery = _owned_recovery_after_stop(cluster, job["id"])
    owner, old_fence = recovery["owner"], recovery["fence"]

    cluster.processes[owner].signal(signal.SIGSTOP)
    cluster.paused.add(owner)
    try:
        taken = wait_recovery(
            cluster, job["id"], lambda r: r[0]["step"] in TERMINAL and r[0]["fence"] > old_fence, timeout_s=30
        )
        assert taken[0]["fence"] > old_fence, f"nobody took over from the paused {owner}: {taken[0]['step']}"
        assert taken[0]["step"] == "running" and taken[0]["owner"] != owner, taken[0]
        job_before = cluster.job(job["id"])
    finally:
        cluster.processes[owner].signal(signal.SIGCONT)
        cluster.paused.discard(owner)

    evidence = poll(lambda: _stand_down_evidence(cluster, owner, old_fence), bool, timeout_s=20)
    print("stand-down evidence:", evidence)
    assert evidence, f"{owner} woke and neither stood down nor was refused by an agent"
    assert cluster.processes[owner].alive()
    assert cluster.recoveries(job["id"]) == taken  # its writes changed nothing
    job_after = cluster.job(job["id"])
    assert {k: job_after[k] for k in ("state", "restart_epoch", "restarts", "placement", "updated_at")} == {
        k: job_before[k] for k in ("state", "restart_epoch", "restarts", "placement", "updated_at")
    }
    lock = redis.Redis.from_url(cluster.redis.url, decode_responses=True).get(f"reprise:lock:job:{job['id']}")
    assert lock is None or not str(lock).startswith(f"{owner}:"), "the woken replica holds the job's lock"
    one_launch_per_node_and_recovery(cluster, job["id"])
    # Whatever the woken owner might still send carries its old fence: every agent refuses it as stale.
    replies = asyncio.run(_command_all(cluster.nats.url, job["id"], fence=old_fence, command_id=f"late-{new_id()}"))
    assert {node: r.result for node, r in replies.items()} == dict.fromkeys(NODES, CommandResult.REJECTED_STALE_FENCE)
    for node in NODES:
        status = httpx.get(cluster.url(node) + "/v1/status", timeout=5).json()
        assert status["commands_executed"] == 3, (node, status["commands_executed"])  # launch, stop, launch


def test_d_a_non_retryable_exit_code_fails_the_job(cluster: Cluster) -> None:
    cluster.start("detector", "reprise_detector", {"REPRISE_DATABASE_URL": f"sqlite:///{cluster.root / 'det.db'}"})
    cluster.wait_ready("detector")
    labels = {"team": "ml", "example.com/tier": "gold"}
    job = cluster.submit(env={"EXIT_CODE": "3"}, policy={"non_retryable_exit_codes": [3]}, labels=labels)

    ended = poll(lambda: cluster.job(job["id"]), lambda j: j["state"] not in ("running", "recovering"), timeout_s=40)
    recoveries = cluster.recoveries(job["id"])
    assert ended["state"] == "failed", (ended["state"], ended.get("detail"), [r["step"] for r in recoveries])
    assert recoveries and recoveries[0]["step"] == "failed", [(r["step"], r["detail"]) for r in recoveries]
    assert cluster.launches(job["id"]) == {node: {0: 1} for node in NODES}  # never relaunched

    # The job's labels travel with every event about it: from its spec onto the placements and recovery changes,
    # and through the detector (which learned them from the placement) onto its incident changes.
    url = cluster.nats.url
    placements = asyncio.run(_stored(url, subjects.placement(job["id"]), "PLACEMENTS"))
    incidents = asyncio.run(_stored(url, f"reprise.incident.{job['id']}.>", "INCIDENTS"))
    changes = asyncio.run(_stored(url, f"reprise.recovery.{job['id']}.>", "RECOVERIES"))
    assert [p.active for p in placements if isinstance(p, JobPlacement)] == [False]  # the latest: the job's end
    assert incidents and changes and any(isinstance(c, RecoveryChange) and c.change == "failed" for c in changes)
    assert all(event.model_dump()["labels"] == labels for event in [*placements, *incidents, *changes])
