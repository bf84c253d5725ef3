"""Three orchestrator replicas as processes, with real Redis, NATS, checkpoint registry and agents (simulated GPUs).

Launches are counted at the agents, from the rank log files they write (one ``started`` line per rank process):
a storm of incidents makes one recovery and one launch per node; a replica killed or paused mid-recovery is
replaced, and the paused one changes nothing when it wakes; a non-retryable exit code fails the job.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from reprise_cli.client import poll
from reprise_cli.redis_server import RedisServer
from reprise_cli.servers import NatsServer, wait_until
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.events import (
    CommandReply,
    CommandResult,
    JobPlacement,
    RecoveryChange,
    StopCommand,
    new_id,
)
from reprise_orchestrator.app import INCIDENTS_DURABLE

from .stack_harness import RANK, Cluster, opened, publish, stored

pytestmark = pytest.mark.stack

REPLICAS = ("orch-0", "orch-1", "orch-2")
NODES = ("node-1", "node-2")
LOCK_TTL_S = 3.0
TERMINAL = ("running", "failed", "held")


@pytest.fixture
def cluster(nats_server: NatsServer, redis_server: RedisServer, tmp_path: Path) -> Iterator[Cluster]:
    """Registry, three orchestrator replicas and two agents, every replica seeing both nodes."""
    (tmp_path / "rank.py").write_text(RANK)
    running = Cluster(
        root=tmp_path, nats=nats_server, redis=redis_server, replicas=REPLICAS, nodes=NODES, lock_ttl_s=LOCK_TTL_S
    )
    try:
        running.start_registry_and_agents()
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


async def _command_all(url: str, job_id: str, *, fence: int, command_id: str) -> dict[str, CommandReply]:
    """A stop with the given fence to every node, as a replica would send it; each node's reply."""
    bus = Bus(url=url, service="test-replicas", provision=False)
    await bus.connect(attempts=10)
    try:
        command = StopCommand(command_id=command_id, job_id=job_id, fence=fence)
        return {node: await bus.request(subjects.node_command(node), command, CommandReply) for node in NODES}
    finally:
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


@pytest.mark.chaos
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
    placements = asyncio.run(stored(url, subjects.placement(job["id"]), "PLACEMENTS"))
    incidents = asyncio.run(stored(url, f"reprise.incident.{job['id']}.>", "INCIDENTS"))
    changes = asyncio.run(stored(url, f"reprise.recovery.{job['id']}.>", "RECOVERIES"))
    assert [p.active for p in placements if isinstance(p, JobPlacement)] == [False]  # the latest: the job's end
    assert incidents and changes and any(isinstance(c, RecoveryChange) and c.change == "failed" for c in changes)
    assert all(event.model_dump()["labels"] == labels for event in [*placements, *incidents, *changes])
