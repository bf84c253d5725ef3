"""What the partition cases watch, as a user would: the job's incidents and recoveries over the REST API, its state and
epoch, and its ranks' steps as each host's agent reports them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from reprise_cli.client import PlatformClient, poll
from reprise_cli.demo.training import Training, job_spec
from reprise_cli.netns import Direction, HostNetwork, Link, NamespacedStack
from reprise_cli.topology import agent_name

# Slow enough to stay far from its last step during a case, fast enough that a stalled rank shows within a second.
TRAINING = Training(steps=100_000, checkpoint_every=20, step_sleep=0.05, in_place=False)
WORKERS = ("node-1", "node-2")  # rank 0 (the rendezvous master) on node-1; the cases cut node-2


@dataclass
class PartitionedJob:
    """A DDP job on namespaced hosts and the client that watches it."""

    stack: NamespacedStack
    client: PlatformClient
    job_id: str
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=1.0))

    @property
    def network(self) -> HostNetwork:
        """The hosts the job runs on."""
        assert self.stack.network is not None
        return self.stack.network

    def close(self) -> None:
        """Close both clients."""
        self.http.close()
        self.client.close()

    def job(self) -> dict[str, Any]:
        """The job as the orchestrator shows it."""
        return self.client.job(self.job_id)

    def incidents(self) -> list[dict[str, Any]]:
        """The job's incidents, as the detector shows them."""
        return self.client.incidents(self.job_id)

    def node_losses(self) -> list[dict[str, Any]]:
        """The job's node-loss incidents (a node said to be gone: its ranks restarted elsewhere)."""
        return [i for i in self.incidents() if i["category"] == "node" and i["recommended_action"] != "none"]

    def recoveries(self) -> list[dict[str, Any]]:
        """The job's recoveries."""
        return self.client.recoveries(self.job_id)

    def ranks(self, node_id: str, *, alive: bool = True) -> list[dict[str, Any]] | None:
        """This job's live ranks on a node (every one it reports, with `alive=False`), from its agent; None while
        the agent does not answer (a cut link)."""
        try:
            status = self.http.get(self.stack.url(agent_name(node_id)) + "/v1/status").json()
        except httpx.HTTPError:
            return None
        return [r for r in status["ranks"] if r["job_id"] == self.job_id and (r["alive"] or not alive)]

    def step(self, node_id: str) -> int | None:
        """The highest step this job's live ranks on a node reached; None when unknown."""
        ranks = self.ranks(node_id)
        steps = [r["step"] for r in ranks or [] if r["step"] is not None]
        return max(steps) if steps else None

    def wait_step_beyond(self, node_id: str, step: int, *, timeout_s: float = 30.0) -> int:
        """Wait until the job's ranks on a node pass `step`; the step they reached."""
        reached = poll(lambda: self.step(node_id), lambda s: s is not None and s > step, timeout_s=timeout_s)
        assert reached is not None and reached > step, (
            f"{node_id}: the job's ranks at step {reached} after {timeout_s} s: {self.ranks(node_id, alive=False)}"
        )
        return reached

    def step_once_back(self, node_id: str, *, beyond: int, timeout_s: float = 15.0) -> int | None:
        """Once a node's agent answers again: the step its ranks of the job passed `beyond` at, or None when it
        runs none (or they do not pass it in time)."""

        def passed(ranks: list[dict[str, Any]] | None) -> bool:
            return ranks is not None and (not ranks or any((r["step"] or -1) > beyond for r in ranks))

        ranks = poll(lambda: self.ranks(node_id), passed, timeout_s=timeout_s)
        steps = [r["step"] for r in ranks or [] if r["step"] is not None and r["step"] > beyond]
        return max(steps) if steps else None

    def checkpoints(self) -> list[dict[str, Any]]:
        """The job's checkpoints in the registry, newest first."""
        url = f"{self.stack.url('checkpoint-registry')}/v1/jobs/{self.job_id}/checkpoints"
        answer = self.client.http.get(url, params={"limit": 1000})  # the client's, with its API key
        return list(answer.raise_for_status().json()["data"])


def submit_training(stack: NamespacedStack, work_dir: Path) -> PartitionedJob:
    """Submit the DDP example on node-1 and node-2, one rank each, and wait until both ranks step."""
    client = stack.client()
    poll(client.nodes, lambda nodes: len(nodes) == 3, timeout_s=30)
    spec = job_spec(TRAINING, name="partitions", nodes=2, min_nodes=2, work_dir=work_dir)
    del spec["policy"]["hang_timeout_s"]  # the platform's learned hang limit, as a user's job has (15 s at least)
    job = PartitionedJob(stack, client, client.submit(spec)["id"])
    assert {r["node_id"] for r in job.job()["placement"]} == set(WORKERS)
    for node in WORKERS:
        job.wait_step_beyond(node, 3, timeout_s=180)  # torch's import and gloo's rendezvous first
    return job


def since(moment: datetime, stamp: str) -> float:
    """Seconds from `moment` to an API timestamp."""
    return (datetime.fromisoformat(stamp) - moment).total_seconds()


def now() -> datetime:
    """The wall clock the services stamp incidents with (same machine)."""
    return datetime.now(UTC)


def sleep_watching(job: PartitionedJob, seconds: float, node_id: str) -> list[int | None]:
    """Sleep `seconds`, sampling a node's step every half second (what the user's dashboard would show)."""
    samples = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        samples.append(job.step(node_id))
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    return samples


# After a heal, watch longer than the detector's report limit (5 s): a verdict reached late would show by then.
SETTLE_S = 7.0


@dataclass(frozen=True)
class RideOut:
    """What one management cut showed: node-1's steps before, during and after, node-2's once back, and what the
    platform said meanwhile."""

    first: int
    during: list[int | None]
    after: list[int | None]
    back: int | None  # node-2's step once its agent answers again (None: it has no rank of the job any more)
    incidents: list[dict[str, Any]]  # opened since the cut, newest first
    recoveries: int  # started since the cut

    def trained_through(self) -> bool:
        """node-1's rank kept stepping during the cut and after it (a data-parallel job needs node-2's rank too)."""
        last, settled = self.during[-1], self.after[-1]
        return last is not None and settled is not None and self.first < last < settled


def ride_out(job: PartitionedJob, *, seconds: float, direction: Direction = Direction.BOTH) -> RideOut:
    """Cut node-2's management link for `seconds` (in `direction`), heal it, and watch the job meanwhile."""
    assert job.job()["restart_epoch"] == 0 and job.step("node-2") is not None, "an earlier case lost node-2's rank"
    incidents, recoveries = len(job.incidents()), len(job.recoveries())
    first = job.step("node-1")
    assert first is not None
    job.network.cut("node-2", links=(Link.MANAGEMENT,), direction=direction)
    cut_at, cut_wall = time.monotonic(), now()
    try:
        during = sleep_watching(job, seconds, "node-1")
    finally:
        job.network.heal("node-2")
    held_s = time.monotonic() - cut_at
    after = sleep_watching(job, SETTLE_S, "node-1")
    back = job.step_once_back("node-2", beyond=first)
    seen = job.incidents()
    outcome = RideOut(first, during, after, back, seen[: len(seen) - incidents], len(job.recoveries()) - recoveries)
    print(
        f"management cut {direction} {seconds:g} s (held {held_s:.1f} s): node-1 steps {first} -> {during[-1]} "
        f"during, {after[-1]} {SETTLE_S:g} s after; node-2 back at step {back}; {len(outcome.incidents)} "
        f"incident(s) {[(i['root_cause'], round(since(cut_wall, i['opened_at']), 2)) for i in outcome.incidents]} "
        f"(text, s after the cut), {outcome.recoveries} recovery(ies)"
    )
    return outcome
