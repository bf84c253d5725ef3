"""Redis losing its data, or going away, while jobs run and recover: recoveries still happen, exactly once each.

Real processes (nats-server, Redis, registry, orchestrator replicas, agents with simulated GPUs). Redis loses its data
as it does after FLUSHALL, a restart without persistence or a failover to an empty replica: the job locks and the
fencing counters are gone while SQL still holds each job's highest fence. The fence floor (docs/orchestrator.md) must
keep every new fence above the stored one, so that a claim after the loss is accepted and the recovery runs.
"""

from __future__ import annotations

import os
import re
import sqlite3
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from reprise_cli.client import poll
from reprise_cli.redis_server import RedisServer
from reprise_cli.servers import ManagedProcess, NatsServer, wait_until
from reprise_common.events import new_id

from .stack_harness import RANK, Cluster, opened, publish

pytestmark = [pytest.mark.stack, pytest.mark.chaos, pytest.mark.timeout(180)]

NODES = ("node-1", "node-2")
LOCK_TTL_S = 3.0
# How long Redis stays away in test d: 1.5 lease times in `make test`, a minute in `make chaos`.
REDIS_AWAY_S = float(os.environ.get("REPRISE_CHAOS_REDIS_AWAY_S", str(LOCK_TTL_S * 1.5)))
TERMINAL = ("running", "failed", "held")


@dataclass
class LossCluster(Cluster):
    """A cluster whose orchestrator replicas also get `orchestrator_env`."""

    orchestrator_env: dict[str, str] = field(default_factory=dict)

    def start(self, name: str, module: str, env: dict[str, str]) -> ManagedProcess:
        """Start a process; an orchestrator replica with the extra settings."""
        extra = self.orchestrator_env if module == "reprise_orchestrator" else {}
        return super().start(name, module, {**env, **extra})

    def stored_fence(self, job_id: str) -> int:
        """The job's highest fence as SQL holds it."""
        with sqlite3.connect(self.root / "orchestrator.db") as db:
            (fence,) = db.execute("select max_fence from job where id = ?", (job_id,)).fetchone()
        return int(fence)

    def redis_fence(self, job_id: str) -> int:
        """The job's fencing counter in Redis (0 when Redis holds none)."""
        client = redis.Redis.from_url(self.redis.url)
        try:
            return int(client.get(f"reprise:fence:job:{job_id}") or 0)
        finally:
            client.close()

    def age_fences(self, job_id: str, by: int) -> None:
        """Move the job's counter on as if it had been recovered many times (lost counters do not catch up by
        themselves then: each pass of a reconciler draws one fence)."""
        client = redis.Redis.from_url(self.redis.url)
        try:
            client.incrby(f"reprise:fence:job:{job_id}", by)
        finally:
            client.close()

    def flushall(self) -> None:
        """Redis loses every lock and every fencing counter."""
        client = redis.Redis.from_url(self.redis.url)
        try:
            assert client.flushall()
        finally:
            client.close()

    def metric(self, replica: str, name: str) -> float:
        """One unlabelled sample from the replica's /metrics (0 when it has none)."""
        text = httpx.get(self.url(replica) + "/metrics", timeout=5).raise_for_status().text
        found = re.search(rf"^{name} (\S+)$", text, re.M)
        return float(found.group(1)) if found else 0.0

    def faults(self, replica: str) -> list[dict[str, Any]]:
        """The replica's log records that carry a traceback, or say a recovery task failed."""
        return [r for r in self.log_records(replica) if "exc" in r or "task failed" in r.get("msg", "")]


StackFactory = Callable[..., LossCluster]


@pytest.fixture
def stack(nats_server: NatsServer, redis_server: RedisServer, tmp_path: Path) -> Iterator[StackFactory]:
    """Starts the registry, two agents and the given orchestrator replicas (with extra settings), every replica
    seeing both nodes; stops them all afterwards."""
    (tmp_path / "rank.py").write_text(RANK)
    started: list[LossCluster] = []

    def start(replicas: tuple[str, ...] = ("orch-0",), **env: str) -> LossCluster:
        running = LossCluster(
            root=tmp_path,
            nats=nats_server,
            redis=redis_server,
            replicas=replicas,
            nodes=NODES,
            lock_ttl_s=LOCK_TTL_S,
            orchestrator_env=env,
        )
        started.append(running)
        running.start_registry_and_agents()
        running.wait_ready("registry")
        running.orchestrator(replicas[0])  # first alone: it creates the tables the others then find
        running.wait_ready(replicas[0])
        for replica in replicas[1:]:
            running.orchestrator(replica)
        running.wait_ready(*replicas[1:], *NODES)
        for replica in replicas:
            assert poll(partial(running.fresh_nodes, replica), lambda n: n == len(NODES), timeout_s=15) == 2
        return running

    try:
        yield start
    finally:
        for running in started:
            for process in reversed(running.processes.values()):
                process.stop(grace_s=10)


Recoveries = list[dict[str, Any]]


def recoveries_until(cluster: Cluster, job_id: str, done: Callable[[Recoveries], bool], timeout_s: float) -> Recoveries:
    """Poll the job's recoveries until done(recoveries) holds; returns the last answer either way."""
    return poll(lambda: cluster.recoveries(job_id), done, timeout_s=timeout_s, interval_s=0.1)


def ended(count: int) -> Callable[[Recoveries], bool]:
    """The job has `count` recoveries and the newest has ended."""
    return lambda found: len(found) >= count and found[0]["step"] in TERMINAL


def summary(recoveries: Recoveries) -> list[tuple[str, str, int, str]]:
    return [(r["id"], r["step"], r["fence"], r["detail"]) for r in recoveries]


def test_a_fault_after_redis_lost_its_data_is_recovered_with_a_higher_fence(stack: StackFactory) -> None:
    # No reconcile pass after the first: the claim itself must find that Redis's counter is behind SQL.
    cluster = stack(REPRISE_RECONCILE_INTERVAL_S="3600")
    job = cluster.submit()
    publish(cluster, [opened(job, incident_id=f"inc-{new_id()[:12]}")])
    first = recoveries_until(cluster, job["id"], ended(1), timeout_s=40)
    assert first and first[0]["step"] == "running", summary(first)
    stored = cluster.stored_fence(job["id"])
    assert stored >= first[0]["fence"]

    cluster.flushall()
    assert cluster.redis_fence(job["id"]) == 0
    publish(cluster, [opened(job, incident_id=f"inc-{new_id()[:12]}")])

    both = recoveries_until(cluster, job["id"], ended(2), timeout_s=40)
    assert len(both) == 2, f"the fault after the loss started no recovery: {summary(both)}"
    second = both[0]
    assert second["step"] == "running" and second["outcome"] == "recovered", summary(both)
    assert second["fence"] > stored, (second["fence"], stored)
    assert cluster.stored_fence(job["id"]) == second["fence"]
    assert cluster.redis_fence(job["id"]) >= second["fence"]  # the next fence is higher still
    assert cluster.job(job["id"])["state"] == "running"
    assert cluster.launches(job["id"]) == {node: {0: 1, 1: 1, 2: 1} for node in NODES}


def test_b_redis_losing_its_data_mid_recovery_leaves_one_recovery_that_completes(stack: StackFactory) -> None:
    cluster = stack(("orch-0", "orch-1"))
    job = cluster.submit(env={"LINGER_S": "2", "RESTART_STARTUP_S": "2"})
    cluster.age_fences(job["id"], 1000)
    publish(cluster, [opened(job, incident_id=f"inc-{new_id()[:12]}")])
    assert recoveries_until(cluster, job["id"], bool, timeout_s=20), "no recovery started"
    assert wait_until(lambda: cluster.stop_arrived(job["id"], 0), timeout_s=15, interval_s=0.02), "no stop arrived"

    cluster.flushall()  # while the owner waits for its ranks to stop

    finished = recoveries_until(cluster, job["id"], ended(1), timeout_s=60)
    assert len(finished) == 1, summary(finished)
    assert finished[0]["step"] == "running", summary(finished)
    assert cluster.job(job["id"])["state"] == "running"
    assert cluster.stored_fence(job["id"]) == finished[0]["fence"]
    assert cluster.redis_fence(job["id"]) >= finished[0]["fence"]
    assert cluster.launches(job["id"]) == {node: {0: 1, 1: 1} for node in NODES}


def test_c_a_lone_owner_takes_back_the_lock_redis_lost_and_finishes_under_its_fence(stack: StackFactory) -> None:
    cluster = stack()  # one replica: nobody else can take the job over while its lock is gone
    job = cluster.submit(env={"LINGER_S": "2", "RESTART_STARTUP_S": "2"})
    cluster.age_fences(job["id"], 1000)
    publish(cluster, [opened(job, incident_id=f"inc-{new_id()[:12]}")])
    started = recoveries_until(cluster, job["id"], bool, timeout_s=20)
    assert started, "no recovery started"
    assert wait_until(lambda: cluster.stop_arrived(job["id"], 0), timeout_s=15, interval_s=0.02), "no stop arrived"

    cluster.flushall()

    finished = recoveries_until(cluster, job["id"], ended(1), timeout_s=60)
    assert len(finished) == 1, summary(finished)
    assert finished[0]["step"] == "running", summary(finished)
    assert (finished[0]["fence"], finished[0]["owner"]) == (started[0]["fence"], started[0]["owner"])
    assert cluster.metric("orch-0", "reprise_orchestrator_locks_retaken_total") == 1
    assert cluster.job(job["id"])["state"] == "running"
    assert cluster.launches(job["id"]) == {node: {0: 1, 1: 1} for node in NODES}


def test_d_redis_away_while_a_recovery_renews_its_lease_then_back(stack: StackFactory) -> None:
    cluster = stack(("orch-0", "orch-1"))
    job = cluster.submit(env={"LINGER_S": "2", "RESTART_STARTUP_S": "2"})
    publish(cluster, [opened(job, incident_id=f"inc-{new_id()[:12]}")])
    assert recoveries_until(cluster, job["id"], bool, timeout_s=20), "no recovery started"
    assert wait_until(lambda: cluster.stop_arrived(job["id"], 0), timeout_s=15, interval_s=0.02), "no stop arrived"

    cluster.redis.stop()
    time.sleep(REDIS_AWAY_S)  # Redis stays away for longer than the lease: renewals fail until it is lost
    cluster.redis.start()

    finished = recoveries_until(cluster, job["id"], ended(1), timeout_s=60)
    assert len(finished) == 1, summary(finished)
    assert finished[0]["step"] == "running", summary(finished)
    assert cluster.job(job["id"])["state"] == "running"
    assert cluster.launches(job["id"]) == {node: {0: 1, 1: 1} for node in NODES}
    for replica in cluster.replicas:
        assert cluster.processes[replica].alive(), replica
        assert not cluster.faults(replica), (replica, cluster.faults(replica))


def test_e_a_replica_starting_after_redis_lost_its_data_floors_the_fences(stack: StackFactory) -> None:
    cluster = stack()
    job = cluster.submit()
    stored = cluster.stored_fence(job["id"])
    assert stored > 0
    cluster.processes["orch-0"].stop(grace_s=10)
    cluster.flushall()

    cluster.orchestrator("orch-0")
    cluster.wait_ready("orch-0")
    assert wait_until(lambda: cluster.redis_fence(job["id"]) >= stored, timeout_s=15), cluster.redis_fence(job["id"])
    assert cluster.redis_fence(job["id"]) == stored  # floored to the stored fence, not beyond


def test_f_a_cancel_after_redis_lost_its_data_stops_the_job(stack: StackFactory) -> None:
    cluster = stack(REPRISE_RECONCILE_INTERVAL_S="3600")  # the cancel itself must find the counter behind SQL
    job = cluster.submit()
    cluster.age_fences(job["id"], 1000)
    publish(cluster, [opened(job, incident_id=f"inc-{new_id()[:12]}")])
    recovered = recoveries_until(cluster, job["id"], ended(1), timeout_s=40)
    assert recovered and recovered[0]["step"] == "running", summary(recovered)
    stored = cluster.stored_fence(job["id"])
    assert stored > 1000

    cluster.flushall()
    with cluster.api() as api:
        response = api.post(f"/v1/jobs/{job['id']}/cancel")
    assert response.status_code == 200, response.text
    assert response.json()["state"] == "cancelled"
    assert cluster.stored_fence(job["id"]) > stored
    assert wait_until(lambda: cluster.stop_arrived(job["id"], 1), timeout_s=15), "the ranks were not stopped"
