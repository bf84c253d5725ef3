"""Acceptance scenarios through a real nats-server and a real database: one incident per fault, the right culprit.

Each scenario plays agents (events and node reports) against a running detector whose clock the test moves, then
the table says how many incidents each job must have and what the first one must say.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest

from reprise_common import subjects
from reprise_common.clock import ManualClock, utcnow
from reprise_common.events import GpuXid, RankExited, RankStatus
from reprise_detector import node_reports

Harness = Any  # tests/conftest.py
StartDetector = Any
GLOO_RESET = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.7]"
NCCL_TIMEOUT = "[Rank 5] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=88, OpType=ALLREDUCE)"


@dataclass(frozen=True)
class Expect:
    """What the incidents of one job must look like after a scenario."""

    count: int
    category: str | None = None
    culprit: tuple[str | None, int | None, int | None] | None = None  # node, gpu, rank
    root_cause_has: str = ""
    symptoms: int | None = None


@dataclass
class World:
    """A running detector with a hand-moved clock."""

    h: Harness
    clock: ManualClock
    extra: dict[str, Any] = field(default_factory=dict)

    async def tick(self, seconds: float = 0.0) -> None:
        """Move the clock, let the detector catch up on every message, then run one watch check."""
        await self.h.settled()
        self.clock.advance(seconds)
        await self.h.runtime.watcher.tick()


Scenario = Callable[[World], Awaitable[None]]


async def one_rank_of_64_killed_and_63_peers_fail(w: World) -> None:
    """Rank 17 is SIGKILLed; its 63 peers fail with gloo / NCCL errors, some reported before the kill arrives."""
    ranks = [(r, f"node-{r // 8}", r % 8) for r in range(64)]
    await w.h.place("job-a", ranks)
    t0 = utcnow()
    peers = [
        RankExited(
            source=node,
            node_id=node,
            job_id="job-a",
            rank=r,
            exit_code=1,
            log_tail=["Traceback (most recent call last):", GLOO_RESET if r % 2 else NCCL_TIMEOUT],
            time=t0 + timedelta(milliseconds=50 + r),
        )
        for r, node, _ in ranks
        if r != 17
    ]
    for peer in peers[:20]:  # these overtake the kill on the wire
        await w.h.emit(peer.node_id, peer)
    await w.h.settled()
    kill = RankExited(source="node-2", node_id="node-2", job_id="job-a", rank=17, signal="SIGKILL", time=t0)
    await w.h.emit("node-2", kill)
    for peer in peers[20:]:
        await w.h.emit(peer.node_id, peer)


async def xid_79_then_crashes_on_that_node(w: World) -> None:
    """GPU 3 of node-1 falls off the bus; the ranks of that node crash after it."""
    await w.h.place("job-a", [(r, f"node-{r // 4}", r % 4) for r in range(8)])
    t0 = utcnow()
    await w.h.emit("node-1", GpuXid(source="node-1", node_id="node-1", gpu=3, xid=79, time=t0))
    for r in range(4, 8):
        crash = RankExited(
            source="node-1", node_id="node-1", job_id="job-a", rank=r, signal="SIGABRT", time=t0 + timedelta(seconds=1)
        )
        await w.h.emit("node-1", crash)


async def node_lost(w: World) -> None:
    """node-2 stops reporting; job-a runs on node-1 and node-2, job-b only on node-1."""
    await w.h.place("job-a", [(0, "node-1", 0), (1, "node-2", 0)])
    await w.h.place("job-b", [(0, "node-1", 1)])
    for _ in range(3):
        await w.h.report("node-1")
        await w.h.report("node-2")
        await w.tick(1.0)
    for _ in range(6):
        await w.h.report("node-1")
        await w.tick(1.0)


async def hang(w: World) -> None:
    """Rank 1 stops at step 10, the others stop one step later (blocked in the next collective).

    Each rank's status says how long ago its last heartbeat was, as an agent's does: the detector dates a step by
    it, since it may read a node's reports seconds after they arrived (node_reports.FOLD_EVERY_S).
    """
    await w.h.place("job-a", [(0, "node-1", 0), (1, "node-1", 1), (2, "node-2", 0), (3, "node-2", 1)])
    reached: dict[int, tuple[int, float]] = {}  # rank -> its step, and when it heartbeated it first (monotonic)

    def statuses(node: str, step_of: Callable[[int], int]) -> list[RankStatus]:
        first, now = (0 if node == "node-1" else 2), w.clock.monotonic()
        for r in (first, first + 1):
            if r not in reached or reached[r][0] != step_of(r):
                reached[r] = (step_of(r), now)
        return [
            RankStatus(
                job_id="job-a",
                rank=r,
                step=reached[r][0],
                phase="training",
                step_time_p99_s=0.2,
                heartbeat_age_s=now - reached[r][1],
            )
            for r in (first, first + 1)
        ]

    for step in range(1, 11):
        for node in ("node-1", "node-2"):
            await w.h.report(node, statuses(node, lambda _r, s=step: s))
        await w.tick(0.2)
    for _ in range(14):
        for node in ("node-1", "node-2"):
            await w.h.report(node, statuses(node, lambda r: 10 if r == 1 else 11))
        await w.tick(1.0)


async def two_faults_in_two_jobs(w: World) -> None:
    """An XID 48 under job-a and a crash of job-b at the same moment."""
    await w.h.place("job-a", [(0, "node-1", 0)])
    await w.h.place("job-b", [(0, "node-2", 0)])
    await w.h.emit("node-1", GpuXid(source="node-1", node_id="node-1", gpu=0, xid=48))
    await w.h.emit("node-2", RankExited(source="node-2", node_id="node-2", job_id="job-b", rank=0, exit_code=1))


async def the_same_event_redelivered(w: World) -> None:
    """One crash published three times without a message id (as redeliveries beyond the duplicate window)."""
    await w.h.place("job-a", [(0, "node-1", 0)])
    crash = RankExited(source="node-1", node_id="node-1", job_id="job-a", rank=0, signal="SIGSEGV")
    for _ in range(3):
        await w.h.agents.js.publish(subjects.node_event("node-1", crash.type), crash.to_bytes())


async def flapping_node(w: World) -> None:
    """node-1 goes silent for 6 s, comes back for 1 s, and does it again five times."""
    await w.h.place("job-a", [(0, "node-1", 0)])
    for _ in range(5):
        await w.h.report("node-1")
        await w.tick(1.0)
        for _ in range(6):
            await w.tick(1.0)


SCENARIOS: list[tuple[Scenario, dict[str, Expect]]] = [
    (
        one_rank_of_64_killed_and_63_peers_fail,
        {"job-a": Expect(1, "process_killed", ("node-2", 1, 17), "SIGKILL", symptoms=64)},
    ),
    (xid_79_then_crashes_on_that_node, {"job-a": Expect(1, "gpu_hardware", ("node-1", 3, 7), "XID 79", symptoms=5)}),
    (node_lost, {"job-a": Expect(1, "node", ("node-2", None, None), "node-2 lost"), "job-b": Expect(0)}),
    (hang, {"job-a": Expect(1, "hang", ("node-1", 1, 1), "hung in training")}),
    (two_faults_in_two_jobs, {"job-a": Expect(1, "gpu_hardware"), "job-b": Expect(1, "application")}),
    (the_same_event_redelivered, {"job-a": Expect(1, "application", ("node-1", 0, 0), "segmentation", symptoms=1)}),
    (flapping_node, {"job-a": Expect(1, "node", ("node-1", None, None), "node-1 lost", symptoms=5)}),
]


async def _played(start_detector: StartDetector, sqlite_url: str, scenario: Scenario) -> Harness:
    """A detector with a hand-moved clock that has handled everything the scenario sent, and its last watch tick."""
    clock = ManualClock(utcnow())
    h = await start_detector(sqlite_url, clock=clock, hang_floor_s=5.0, hang_k=5.0, watch_interval_s=3600)
    world = World(h, clock)
    await scenario(world)
    await world.tick()
    await h.settled()
    return h


@pytest.mark.parametrize(("scenario", "expected"), SCENARIOS, ids=[s.__name__ for s, _ in SCENARIOS])
async def test_scenario(
    start_detector: StartDetector, sqlite_url: str, scenario: Scenario, expected: dict[str, Expect]
) -> None:
    h = await _played(start_detector, sqlite_url, scenario)
    for job_id, want in expected.items():
        incidents = await h.open_incidents(job_id)
        assert len(incidents) == want.count, (job_id, [i["root_cause"] for i in incidents])
        if not want.count:
            continue
        incident = incidents[0]
        if want.category:
            assert incident["category"] == want.category, incident
        if want.culprit:
            got = (incident["culprit_node_id"], incident["culprit_gpu"], incident["culprit_rank"])
            assert got == want.culprit, incident
        assert want.root_cause_has in incident["root_cause"], incident
        if want.symptoms is not None:
            assert incident["symptom_count"] == want.symptoms, incident
        opened = [c for c in await h.changes(job_id) if c.change == "opened"]
        assert len(opened) == want.count, opened


@pytest.mark.parametrize("draws", [(0.4, 0.0), (0.4, 0.8), (0.6, 0.2), (0.6, 0.8)])
async def test_a_hang_blames_the_rank_that_stopped_first_whenever_its_nodes_reports_are_folded(
    start_detector: StartDetector, sqlite_url: str, monkeypatch: pytest.MonkeyPatch, draws: tuple[float, float]
) -> None:
    """The nodes' reports are folded seconds apart, at moments drawn at random (node_reports.FOLD_EVERY_S): the culprit
    is the rank whose step came first by the reports' ages, not by when each node was folded."""
    draw = itertools.cycle(draws)
    monkeypatch.setattr(node_reports.random, "random", lambda: next(draw))
    h = await _played(start_detector, sqlite_url, hang)
    [incident] = await h.open_incidents("job-a")
    assert (incident["culprit_node_id"], incident["culprit_rank"]) == ("node-1", 1), incident["root_cause"]


async def test_secondary_symptoms_are_evidence_with_their_log_tails(
    start_detector: StartDetector, sqlite_url: str
) -> None:
    h = await start_detector(sqlite_url)
    await one_rank_of_64_killed_and_63_peers_fail(World(h, ManualClock()))
    await h.settled()
    [incident] = await h.open_incidents("job-a")
    detail = await h.incident(incident["id"])
    decisions = [s["decision"] for s in detail["symptoms"]]
    assert decisions.count("open") == 1 and decisions.count("suppress") == 63
    leader = next(s for s in detail["symptoms"] if s["decision"] == "open")
    assert leader["rank"] == 17 and leader["root_cause_grade"]
    evidence = [s for s in detail["symptoms"] if s["decision"] == "suppress"]
    assert all(not s["root_cause_grade"] for s in evidence)
    assert any("Connection closed by peer" in s["detail"] for s in evidence)
    assert any("collective operation timeout" in s["detail"] for s in evidence)
