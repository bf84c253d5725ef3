"""Recoveries run side by side: twenty jobs faulted at once on one replica all recover, each once, together.

Real processes (nats-server, Redis, registry, one orchestrator, twenty agents with simulated GPUs); every job runs one
rank on a node of its own, and its rank takes a second to stop, so twenty recoveries one after another would take
twenty seconds of stops. The incidents are published at once, as a bad switch under ten jobs would make them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from reprise_cli.client import poll
from reprise_cli.redis_server import RedisServer
from reprise_cli.servers import NatsServer
from reprise_common.events import new_id

from .stack_harness import RANK, Cluster, opened, publish

pytestmark = [pytest.mark.stack, pytest.mark.timeout(240)]

JOBS = 20
REPLICA = "orch-0"
NODES = tuple(f"node-{index:02d}" for index in range(JOBS))
TERMINAL = ("running", "failed", "held")


@pytest.fixture
def many(nats_server: NatsServer, redis_server: RedisServer, tmp_path: Path) -> Iterator[Cluster]:
    """Registry, one orchestrator and twenty agents."""
    (tmp_path / "rank.py").write_text(RANK)
    running = Cluster(root=tmp_path, nats=nats_server, redis=redis_server, replicas=(REPLICA,), nodes=NODES)
    try:
        running.start_registry_and_agents()
        running.wait_ready("registry")
        running.orchestrator(REPLICA)
        running.wait_ready(REPLICA, *NODES)
        assert poll(partial(running.fresh_nodes, REPLICA), lambda n: n == JOBS, timeout_s=30) == JOBS
        yield running
    finally:
        for process in reversed(running.processes.values()):
            process.stop(grace_s=10)


def _span(recovery: dict[str, Any], step: str) -> tuple[float, float]:
    found = next(s for s in recovery["steps"] if s["step"] == step)
    return _ts(found["started_at"]), _ts(found["ended_at"])


def _ts(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def most_at_once(spans: list[tuple[float, float]]) -> int:
    """The largest number of spans that share one instant."""
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    best = now = 0
    for _, change in edges:
        now += change
        best = max(best, now)
    return best


def test_twenty_jobs_faulted_at_once_on_one_replica_recover_side_by_side(many: Cluster) -> None:
    jobs = [many.submit(nodes=(node,), env={"LINGER_S": "1"}) for node in NODES]
    published = time.time()
    publish(many, [opened(job, incident_id=f"inc-{new_id()[:12]}") for job in jobs])

    def ended() -> dict[str, list[dict[str, Any]]]:
        return {job["id"]: many.recoveries(job["id"]) for job in jobs}

    done = poll(ended, lambda found: all(r and r[0]["step"] in TERMINAL for r in found.values()), timeout_s=120)
    outcomes = {job_id: [(r["step"], r["outcome"]) for r in found] for job_id, found in done.items()}
    assert all(found == [("running", "recovered")] for found in outcomes.values()), outcomes
    assert {job["id"]: many.job(job["id"])["state"] for job in jobs} == dict.fromkeys(outcomes, "running")
    launches = {node: many.launches(job["id"])[node] for job, node in zip(jobs, NODES, strict=True)}
    assert launches == {node: {0: 1, 1: 1} for node in NODES}  # at submit, and for its job's one recovery

    # Side by side: each stop waits a second for its rank, and the stops of most jobs were under way together.
    stops = [_span(found[0], "stopping_ranks") for found in done.values()]
    together = most_at_once(stops)
    finished = max(_ts(found[0]["finished_at"]) for found in done.values())
    print(f"{JOBS} recoveries: at most {together} stopping at once; the last running {finished - published:.2f} s "
          f"after the incidents were published")  # fmt: skip
    assert together >= JOBS // 2, stops


@pytest.fixture
def one_node(nats_server: NatsServer, redis_server: RedisServer, tmp_path: Path) -> Iterator[Cluster]:
    """Registry, one orchestrator, one agent."""
    (tmp_path / "rank.py").write_text(RANK)
    running = Cluster(root=tmp_path, nats=nats_server, redis=redis_server, replicas=(REPLICA,), nodes=NODES[:1])
    try:
        running.start_registry_and_agents()
        running.wait_ready("registry")
        running.orchestrator(REPLICA)
        running.wait_ready(REPLICA, *NODES[:1])
        assert poll(partial(running.fresh_nodes, REPLICA), lambda n: n == 1, timeout_s=30) == 1
        yield running
    finally:
        for process in reversed(running.processes.values()):
            process.stop(grace_s=10)


async def _burst(url: str, paths: list[str], api_key: str) -> list[int]:
    headers = {"Authorization": f"Bearer {api_key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as client:
        answers = await asyncio.gather(*(client.get(path) for path in paths), return_exceptions=True)
    return [a.status_code if isinstance(a, httpx.Response) else 0 for a in answers]


def test_many_requests_at_once_never_starve_the_replicas_own_work(one_node: Cluster) -> None:
    """Request handlers run in threads, the replica's consumers and reconciler on its event loop, all from one pool of
    database connections: a burst of requests must neither hold every connection nor wait on one another."""
    job = one_node.submit()
    publish(one_node, [opened(job, incident_id=f"inc-{new_id()[:12]}")])
    assert poll(lambda: one_node.recoveries(job["id"]), lambda r: bool(r) and r[0]["step"] == "running", timeout_s=30)
    paths = [f"/v1/jobs/{job['id']}/recoveries", f"/v1/jobs/{job['id']}", "/v1/jobs", "/readyz"] * 20
    for _ in range(5):
        started = time.monotonic()
        answers = asyncio.run(_burst(one_node.url(REPLICA), paths, one_node.api_key))
        print(f"{len(paths)} requests at once: {time.monotonic() - started:.2f} s, answers {sorted(set(answers))}")
        assert answers == [200] * len(paths), sorted(answers)


LONG_LEASE_S = 30.0  # far longer than a takeover after a release takes: only a released lock explains a quick one


@pytest.fixture
def two_replicas(nats_server: NatsServer, redis_server: RedisServer, tmp_path: Path) -> Iterator[Cluster]:
    """Registry, two orchestrator replicas with a long lock lease, two agents."""
    (tmp_path / "rank.py").write_text(RANK)
    running = Cluster(
        root=tmp_path,
        nats=nats_server,
        redis=redis_server,
        replicas=("orch-0", "orch-1"),
        nodes=NODES[:2],
        lock_ttl_s=LONG_LEASE_S,
    )
    try:
        running.start_registry_and_agents()
        running.wait_ready("registry")
        running.orchestrator("orch-0")  # first alone: it creates the tables the other then finds
        running.wait_ready("orch-0")
        running.orchestrator("orch-1")
        running.wait_ready("orch-1", *NODES[:2])
        for replica in running.replicas:
            assert poll(partial(running.fresh_nodes, replica), lambda n: n == 2, timeout_s=30) == 2
        yield running
    finally:
        for process in reversed(running.processes.values()):
            process.stop(grace_s=10)


def test_a_replica_that_stops_leaves_its_recoveries_to_another_at_once(two_replicas: Cluster) -> None:
    """A replica stopped (SIGTERM) in the middle of a recovery releases the job's lock as it goes, so the other
    replica's reconciler resumes the recovery at once, not after the lock's 30 s lease; the job launches once."""
    cluster = two_replicas
    job = cluster.submit(env={"LINGER_S": "2"})  # each rank takes 2 s to stop: the stop is under way for a while
    publish(cluster, [opened(job, incident_id=f"inc-{new_id()[:12]}")])
    stopping = poll(lambda: cluster.recoveries(job["id"]), lambda r: bool(r) and r[0]["step"] == "stopping_ranks",
                    timeout_s=20, interval_s=0.02)  # fmt: skip
    owner = stopping[0]["owner"]
    other = next(r for r in cluster.replicas if r != owner)
    cluster.paused.add(owner)  # REST calls go to the other replica from now on
    stopped_at = time.monotonic()
    cluster.processes[owner].stop(grace_s=20)  # SIGTERM: a graceful shutdown

    done = poll(lambda: cluster.recoveries(job["id"]), lambda r: r[0]["step"] in TERMINAL, timeout_s=LONG_LEASE_S)
    took = time.monotonic() - stopped_at
    print(f"{owner} stopped; {other} finished its recovery {took:.1f} s later")
    assert (done[0]["step"], done[0]["owner"]) == ("running", other), done[0]
    assert took < LONG_LEASE_S / 2, f"taken over after {took:.1f} s: the lock waited for its lease, not released"
    assert cluster.launches(job["id"]) == {node: {0: 1, 1: 1} for node in NODES[:2]}
    assert any(r.get("msg") == "recovery left to another replica" for r in cluster.log_records(owner))
