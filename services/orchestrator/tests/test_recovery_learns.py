"""A running recovery and what it learns meanwhile: one orchestrator, one detector, two workers and a spare.

A rank is killed and the GPU of the job's other node falls off the bus 50 ms later: the detector upgrades the
incident to the hardware fault while the recovery runs, and the recovery must act on it (cordon that node, a spare in
its place, one launch per node). A relaunched rank dies while its recovery verifies it, and the recovery's next
attempt replaces that epoch: the death's incident must not start a second recovery once the job runs again. A second
death in the epoch being stopped starts no second recovery either.

Real processes throughout (nats-server, Redis, registry, detector, orchestrator, agents with simulated GPUs); faults
are injected over NATS from the test, so their spacing is the test's. Launches are counted from the agents' rank logs.
"""

from __future__ import annotations

import asyncio
import signal
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
from reprise_cli.servers import NatsServer, wait_until
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.events import FaultKind, IncidentChange, InjectFault, InjectReply, NodeReport, RankStatus

from .stack_harness import RANK, Cluster, stored

pytestmark = pytest.mark.stack

REPLICA = "orch-0"
NODES = ("node-1", "node-2")
SPARE = "spare-1"
TERMINAL = ("running", "failed", "held")
POLICY = {"backoff_initial_s": 0.2, "verify_timeout_s": 15}
QUIET_S = 4.0  # a settled job: every recovery ended and none began for this long


@pytest.fixture
def stack(nats_server: NatsServer, redis_server: RedisServer, tmp_path: Path) -> Iterator[Cluster]:
    """Registry, one detector, one orchestrator, two worker agents and a spare agent (one simulated GPU each)."""
    (tmp_path / "rank.py").write_text(RANK)
    running = Cluster(
        root=tmp_path, nats=nats_server, redis=redis_server, replicas=(REPLICA,), nodes=NODES, spares=(SPARE,)
    )
    try:
        running.start("detector", "reprise_detector", {"REPRISE_DATABASE_URL": f"sqlite:///{tmp_path / 'det.db'}"})
        running.start_registry_and_agents()
        running.wait_ready("registry")
        running.orchestrator(REPLICA)
        running.wait_ready("detector", REPLICA, *NODES, SPARE)
        assert poll(partial(running.fresh_nodes, REPLICA), lambda n: n == 3, timeout_s=15) == 3
        yield running
    finally:
        for process in reversed(running.processes.values()):
            process.signal(signal.SIGCONT)
            process.stop(grace_s=10)


async def _inject(url: str, faults: list[tuple[str, InjectFault]], spacing_s: float) -> list[tuple[float, InjectReply]]:
    bus = Bus(url=url, service="test-recovery-learns", provision=False)
    await bus.connect(attempts=10)
    replies = []
    try:
        for index, (node, fault) in enumerate(faults):
            if index:
                await asyncio.sleep(spacing_s)
            sent = time.time()
            replies.append((sent, await bus.request(subjects.node_inject(node), fault, InjectReply)))
    finally:
        await bus.close()
    return replies


def inject(cluster: Cluster, *faults: tuple[str, InjectFault], spacing_s: float = 0.05) -> list[InjectReply]:
    """Inject each fault into its node, `spacing_s` apart; every fault must be accepted."""
    replies = asyncio.run(_inject(cluster.nats.url, list(faults), spacing_s))
    for (node, fault), (sent, reply) in zip(faults, replies, strict=True):
        print(f"injected at {sent:.3f}: {node} {fault.kind.value} rank={fault.rank}: {reply.detail}")
        assert reply.accepted, (node, fault, reply.detail)
    return [reply for _, reply in replies]


async def _reports(url: str, nodes: tuple[str, ...], listen_s: float) -> dict[str, NodeReport]:
    bus = Bus(url=url, service="test-recovery-learns", provision=False)
    await bus.connect(attempts=10)
    latest: dict[str, NodeReport] = {}
    try:
        sub = await bus.nc.subscribe(subjects.AGENT_REPORTS)
        deadline = time.monotonic() + listen_s
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                msg = await sub.next_msg(timeout=remaining)
            except TimeoutError:
                break
            node = subjects.node_from_agent_subject(msg.subject)
            if node in nodes:
                latest[node] = NodeReport.model_validate_json(msg.data)
        await sub.unsubscribe()
    finally:
        await bus.close()
    return latest


def ranks_reported(cluster: Cluster, job: dict[str, Any]) -> dict[int, RankStatus]:
    """The job's ranks of its current epoch as the latest node reports show them, by rank."""
    nodes = (*cluster.nodes, *cluster.spares)
    reports = asyncio.run(_reports(cluster.nats.url, nodes, listen_s=1.2))
    return {
        rank.rank: rank
        for report in reports.values()
        for rank in report.ranks
        if rank.job_id == job["id"] and rank.restart_epoch == job["restart_epoch"]
    }


def not_progressing(cluster: Cluster, job: dict[str, Any]) -> list[str]:
    """Why the ranks of the job's current epoch are not all alive and stepping (empty when they are)."""
    wanted = {r["rank"] for r in job["placement"]}
    first = ranks_reported(cluster, job)
    second = ranks_reported(cluster, job)
    problems = []
    for rank in sorted(wanted):
        before, after = first.get(rank), second.get(rank)
        if after is None or before is None:
            problems.append(f"rank {rank} of epoch {job['restart_epoch']} not reported")
        elif not after.alive:
            problems.append(f"rank {rank} of epoch {job['restart_epoch']} dead (exit {after.exit_code})")
        elif (after.step or 0) <= (before.step or 0):
            problems.append(f"rank {rank} of epoch {job['restart_epoch']} stuck at step {after.step}")
    return problems


def settle(cluster: Cluster, job_id: str, *, timeout_s: float = 40.0) -> list[dict[str, Any]]:
    """The job's recoveries once at least one began and all ended, none beginning for QUIET_S; newest first."""
    deadline = time.monotonic() + timeout_s
    last: list[dict[str, Any]] = []
    quiet_since: float | None = None
    while time.monotonic() < deadline:
        now = cluster.recoveries(job_id)
        done = bool(now) and all(r["step"] in TERMINAL for r in now)
        if done and [r["id"] for r in now] == [r["id"] for r in last]:
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since >= QUIET_S:
                return now
        else:
            quiet_since = None
        last = now
        time.sleep(0.1)
    return last


def _at(value: str | datetime) -> float:
    return (datetime.fromisoformat(value) if isinstance(value, str) else value).timestamp()


def timeline(cluster: Cluster, job_id: str, t0: float) -> list[str]:
    """Incident changes (as published) and recovery steps, in time order, in seconds from t0."""
    rows: list[tuple[float, str]] = []
    changes = asyncio.run(stored(cluster.nats.url, f"reprise.incident.{job_id}.>", "INCIDENTS"))
    for change in changes:
        if isinstance(change, IncidentChange):
            culprit = change.culprit
            rows.append(
                (
                    _at(change.time),
                    f"incident {change.change} {change.incident_id} {change.category.value}/"
                    f"{change.recommended_action.value} culprit={culprit.node_id}:rank {culprit.rank} "
                    f"first_symptom_at={_at(change.first_symptom_at) - t0:+.3f} ({change.root_cause})",
                )
            )
    for recovery in cluster.recoveries(job_id):
        for step in recovery["steps"]:
            ended = f"{_at(step['ended_at']) - t0:+.3f}" if step.get("ended_at") else "-"
            data = step.get("data") or {}
            extra = {k: data[k] for k in ("nodes", "replaced", "cordoned", "excluded", "restart_epoch") if k in data}
            rows.append(
                (
                    _at(step["started_at"]),
                    f"recovery {recovery['id']} (incident {recovery['incident_id']}) attempt {step.get('attempt', 1)} "
                    f"{step['step']} until {ended} {extra or ''}",
                )
            )
    return [f"{at - t0:+8.3f}  {text}" for at, text in sorted(rows)]


def incidents(cluster: Cluster, job_id: str) -> list[dict[str, Any]]:
    """The job's incidents as the detector's REST API lists them, newest first."""
    response = httpx.get(
        cluster.url("detector") + "/v1/incidents",
        params={"job_id": job_id},
        headers={"Authorization": f"Bearer {cluster.api_key}"},
        timeout=10,
    )
    return list(response.raise_for_status().json()["data"])


def nodes_view(cluster: Cluster) -> dict[str, dict[str, Any]]:
    """The orchestrator's nodes, by id."""
    with cluster.api() as api:
        return {n["node_id"]: n for n in api.get("/v1/nodes").raise_for_status().json()}


def show(cluster: Cluster, job_id: str, t0: float) -> None:
    """Print what happened, for the reader of a failure."""
    print("\n".join(timeline(cluster, job_id, t0)))
    for incident in incidents(cluster, job_id):
        print(
            f"detector incident {incident['id']} {incident['state']} {incident['category']} "
            f"culprit={incident['culprit_node_id']}:rank {incident['culprit_rank']} "
            f"symptoms={incident['symptom_count']} first_symptom_at={_at(incident['first_symptom_at']) - t0:+.3f}"
        )


def test_a_a_recovery_follows_its_incident_upgraded_to_a_lost_gpu(stack: Cluster) -> None:
    """A rank is killed, and 50 ms later the GPU of the job's other node falls off the bus (XID 79)."""
    job = stack.submit(policy=POLICY)
    by_rank = {r["rank"]: r["node_id"] for r in job["placement"]}
    killed, lost = by_rank[0], by_rank[1]
    t0 = time.time()
    inject(
        stack,
        (killed, InjectFault(kind=FaultKind.RANK_KILL, rank=0, job_id=job["id"])),
        (lost, InjectFault(kind=FaultKind.XID, gpu=0, xid=79)),
        spacing_s=0.05,
    )
    recoveries = settle(stack, job["id"])
    show(stack, job["id"], t0)
    assert recoveries and all(r["step"] in TERMINAL for r in recoveries), [(r["id"], r["step"]) for r in recoveries]

    final = stack.job(job["id"])
    epoch = final["restart_epoch"]
    # The XID reaches the orchestrator 50 ms after the kill, while the first attempt restores; on a busy host it can
    # come just after that attempt began launching, and the re-plan then stops the launch before its ranks start (an
    # epoch whose rank logs show no process started). What must not happen is a rank started twice for the fault.
    started = {node: {e: n for e, n in epochs.items() if n} for node, epochs in stack.launches(job["id"]).items()}
    seen = {
        "cordoned": nodes_view(stack)[lost]["cordoned"],
        "placement": [r["node_id"] for r in final["placement"]],
        "state": final["state"],
        "launches": started,
        "not progressing": not_progressing(stack, final),
    }
    print(seen, stack.launches(job["id"]))
    # The lost GPU's node is cordoned and a spare takes its place; each node started its ranks once for the fault.
    assert seen == {
        "cordoned": True,
        "placement": [killed, SPARE],
        "state": "running",
        "launches": {killed: {0: 1, epoch: 1}, lost: {0: 1}, SPARE: {epoch: 1}},
        "not progressing": [],
    }


def _started(cluster: Cluster, job_id: str, node: str, epoch: int) -> bool:
    logs = [p for p in cluster.rank_logs(job_id, node) if p.name.startswith(f"epoch-{epoch}-")]
    return bool(logs) and all(p.read_text().startswith("started ") for p in logs)


def _step(cluster: Cluster, job_id: str) -> str | None:
    recoveries = cluster.recoveries(job_id)
    return recoveries[0]["step"] if recoveries else None


def test_b_a_death_in_an_epoch_the_recovery_replaced_starts_no_second_recovery(stack: Cluster) -> None:
    """Rank 0 is killed; its relaunch (epoch 1) is killed too while the recovery verifies it, so the recovery's
    second attempt replaces epoch 1 with epoch 2. The incident of that second death is about epoch 1: it belongs to
    the recovery that replaced it and must not start another one once the job runs again."""
    # A relaunched rank takes 1.5 s before its first step, so the recovery is still verifying epoch 1 when it dies.
    job = stack.submit(policy=POLICY, env={"RESTART_STARTUP_S": "1.5"})
    node = next(r["node_id"] for r in job["placement"] if r["rank"] == 0)
    t0 = time.time()
    inject(stack, (node, InjectFault(kind=FaultKind.RANK_KILL, rank=0, job_id=job["id"])))
    verifying = lambda: _step(stack, job["id"]) == "verifying" and _started(stack, job["id"], node, 1)  # noqa: E731
    assert wait_until(verifying, timeout_s=15, interval_s=0.01), stack.recoveries(job["id"])[:1]
    inject(stack, (node, InjectFault(kind=FaultKind.RANK_KILL, rank=0, job_id=job["id"])))
    recoveries = settle(stack, job["id"])
    show(stack, job["id"], t0)

    final = stack.job(job["id"])
    seen = {
        "recoveries": [(r["step"], r["attempt"]) for r in recoveries],
        "state": final["state"],
        "launches": stack.launches(job["id"]),
        "not progressing": not_progressing(stack, final),
    }
    print(seen)
    # One recovery of two attempts: epoch 1, then epoch 2 in its place; no epoch 3.
    assert seen == {
        "recoveries": [("running", 2)],
        "state": "running",
        "launches": {n: {0: 1, 1: 1, 2: 1} for n in NODES},
        "not progressing": [],
    }


@pytest.mark.parametrize("when", ["before-the-stop", "while-lingering-in-the-stop"])
def test_b_a_second_death_in_the_stopped_epoch_starts_no_second_recovery(stack: Cluster, when: str) -> None:
    """Rank 0 is killed, then rank 1 of the same epoch: before the stop reaches it (its exit is reported), or while
    it lingers on the stop's SIGTERM (its exit is part of the stop). One recovery, one relaunch per node."""
    job = stack.submit(policy=POLICY, env={"LINGER_S": "2"})
    by_rank = {r["rank"]: r["node_id"] for r in job["placement"]}
    t0 = time.time()
    first = (by_rank[0], InjectFault(kind=FaultKind.RANK_KILL, rank=0, job_id=job["id"]))
    second = (by_rank[1], InjectFault(kind=FaultKind.RANK_KILL, rank=1, job_id=job["id"]))
    if when == "before-the-stop":
        inject(stack, first, second, spacing_s=0)
    else:
        inject(stack, first)
        lingering = lambda: "sigterm" in stack.rank_logs(job["id"], by_rank[1])[0].read_text()  # noqa: E731
        assert wait_until(lingering, timeout_s=10, interval_s=0.01), "the stop did not reach rank 1"
        assert _step(stack, job["id"]) == "stopping_ranks"
        inject(stack, second)
    recoveries = settle(stack, job["id"])
    show(stack, job["id"], t0)

    final = stack.job(job["id"])
    seen = {
        "recoveries": [r["step"] for r in recoveries],
        "state": final["state"],
        "launches": stack.launches(job["id"]),
        "not progressing": not_progressing(stack, final),
    }
    print(seen)
    assert seen == {
        "recoveries": ["running"],
        "state": "running",
        "launches": {n: {0: 1, 1: 1} for n in NODES},
        "not progressing": [],
    }
