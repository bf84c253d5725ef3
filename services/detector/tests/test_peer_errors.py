"""Peers' errors as early evidence of node loss, on the real detector: a rank failing in gloo because its peer went
away, while a node of its job has missed its reports for 1.5 of its intervals, makes that node lost at once instead of
after the 5 s of silence; neither the error nor the short silence alone does."""

from __future__ import annotations

from typing import Any

from reprise_common.clock import ManualClock, utcnow
from reprise_common.events import Event, NodeReport, RankExited, RankParked

from .conftest import Harness, StartDetector, wait_until

JOB = "job-p"
NODES = ("node-1", "node-2", "node-3")  # rank n on node-(n+1)
GLOO_RESET = [
    "Traceback (most recent call last):",
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:4711",
]


def _exit(node: str, rank: int, log_tail: list[str], exit_code: int = 1) -> RankExited:
    return RankExited(
        source=node, node_id=node, job_id=JOB, rank=rank, exit_code=exit_code, log_tail=log_tail, restart_epoch=0
    )


def _parked(node: str, rank: int, why: str) -> RankParked:
    return RankParked(source=node, node_id=node, job_id=JOB, rank=rank, restart_epoch=0, why=why)


async def _start(start_detector: StartDetector, sqlite_url: str) -> tuple[Harness, ManualClock]:
    """A detector on a manual clock whose watch looks only when told (or when a peer error's node comes due), with
    the job's three ranks placed and every node reporting (interval 1 s)."""
    clock = ManualClock(utcnow())
    h = await start_detector(sqlite_url, clock=clock, watch_interval_s=3600, hang_check_interval_s=3600)
    await h.place(JOB, [(rank, node, 0) for rank, node in enumerate(NODES)])
    await _round(h, NODES)
    return h, clock


async def _round(h: Harness, nodes: tuple[str, ...]) -> None:
    for node in nodes:
        await h.report(node)
    await h.settled()


async def _look(h: Harness) -> list[dict[str, Any]]:
    await h.runtime.watcher.tick()
    incidents: list[dict[str, Any]] = await h.open_incidents(JOB)
    return incidents


async def _node_2_lost_early(h: Harness, clock: ManualClock, evidence: Event) -> dict[str, Any]:
    """node-2 dies; its peer on node-1 says so a second later (`evidence`): nothing yet after one interval of silence,
    node-2 lost after 1.8 s, far from the 5 s limit. The lost node's incident."""
    clock.advance(1.0)
    await _round(h, ("node-1", "node-3"))  # node-2's last report was a second ago
    await h.emit("node-1", evidence)
    await h.settled()
    assert await _look(h) == []  # silent for one interval only: a report may still come
    clock.advance(0.8)
    await _round(h, ("node-1", "node-3"))
    [incident] = await _look(h)
    assert (incident["category"], incident["culprit_node_id"]) == ("node", "node-2")
    assert incident["root_cause"].startswith("node node-2 lost: its peers' collectives failed (rank 0 on node-1: ")
    assert "Connection closed by peer" in incident["root_cause"]
    health = {n["node_id"]: n["state"] for n in (await h.client.get("/v1/node-health")).json()["data"]}
    assert health == {"node-1": "alive", "node-2": "lost", "node-3": "alive"}
    return incident


async def test_a_peer_error_and_a_node_silent_for_1_5_intervals_make_it_lost_before_the_limit(
    start_detector: StartDetector, sqlite_url: str
) -> None:
    h, clock = await _start(start_detector, sqlite_url)
    incident = await _node_2_lost_early(h, clock, _exit("node-1", 0, GLOO_RESET))
    assert incident["recommended_action"] == "restart_exclude_node"
    assert incident["root_cause"].endswith("and it has not reported for 1.8 s")
    assert incident["symptom_count"] == 2  # the lost node and the peer's exit, adopted as evidence


async def test_the_same_silence_without_a_peer_error_waits_for_the_limit(
    start_detector: StartDetector, sqlite_url: str
) -> None:
    h, clock = await _start(start_detector, sqlite_url)
    for step in (1.0, 0.8, 1.0, 1.0, 1.0):  # node-2 silent for 1.0, 1.8, ... 4.8 s
        clock.advance(step)
        await _round(h, ("node-1", "node-3"))
        assert await _look(h) == []
    clock.advance(0.3)
    await _round(h, ("node-1", "node-3"))
    [incident] = await _look(h)
    assert incident["culprit_node_id"] == "node-2"
    assert incident["root_cause"] == "node node-2 lost: no report for 5.1 s"


async def test_a_peer_error_while_every_node_reports_calls_no_node_lost(
    start_detector: StartDetector, sqlite_url: str
) -> None:
    h, clock = await _start(start_detector, sqlite_url)
    clock.advance(0.5)
    await h.emit("node-2", _exit("node-2", 1, ["Fatal Python error: Segmentation fault"], exit_code=-11))
    await h.emit("node-1", _exit("node-1", 0, GLOO_RESET))
    await h.emit("node-3", _exit("node-3", 2, GLOO_RESET))
    await h.settled()
    for _ in range(4):  # every node reports each second; each look comes 1.2 s after the last reports
        clock.advance(0.7)
        await _round(h, NODES)
        clock.advance(1.2)
        [incident] = await _look(h)
        assert (incident["category"], incident["culprit_node_id"], incident["culprit_rank"]) == (
            "application",
            "node-2",
            1,
        )
        assert "segmentation fault" in incident["root_cause"]
    assert incident["symptom_count"] == 3  # the crash and its two peers' errors, as before
    health = {n["node_id"]: n["state"] for n in (await h.client.get("/v1/node-health")).json()["data"]}
    assert set(health.values()) == {"alive"}


async def test_peer_errors_a_crash_explains_are_no_evidence_against_a_late_node(
    start_detector: StartDetector, sqlite_url: str
) -> None:
    h, clock = await _start(start_detector, sqlite_url)
    clock.advance(0.5)
    await h.emit("node-2", _exit("node-2", 1, ["Fatal Python error: Segmentation fault"], exit_code=-11))
    await h.emit("node-1", _exit("node-1", 0, GLOO_RESET))
    await h.settled()
    clock.advance(1.3)
    await _round(h, ("node-1", "node-2"))  # node-3's report is late (a loaded host): 1.8 s since its last
    [incident] = await _look(h)
    assert (incident["category"], incident["culprit_node_id"], incident["culprit_rank"]) == ("application", "node-2", 1)
    health = {n["node_id"]: n["state"] for n in (await h.client.get("/v1/node-health")).json()["data"]}
    assert set(health.values()) == {"alive"}


async def test_a_node_is_weighed_against_its_own_report_interval(
    start_detector: StartDetector, sqlite_url: str
) -> None:
    h, clock = await _start(start_detector, sqlite_url)
    slow = NodeReport(source="node-2", node_id="node-2", interval_s=2.0, gpu_backend="sim")
    await h.report_bytes("node-2", slow.to_bytes())  # node-2 reports every 2 s
    await h.settled()
    clock.advance(1.0)
    await _round(h, ("node-1", "node-3"))
    await h.emit("node-1", _exit("node-1", 0, GLOO_RESET))
    await h.settled()
    clock.advance(1.5)
    await _round(h, ("node-1", "node-3"))
    assert await _look(h) == []  # 2.5 s of silence: not 1.5 of its intervals yet
    clock.advance(0.7)
    await _round(h, ("node-1", "node-3"))
    [incident] = await _look(h)
    assert incident["culprit_node_id"] == "node-2"
    assert incident["root_cause"].endswith("and it has not reported for 3.2 s")


async def test_the_watch_looks_when_the_silent_node_comes_due_without_waiting_for_its_tick(
    start_detector: StartDetector, sqlite_url: str
) -> None:
    # The detector's own clock: the watch's interval is an hour and the silence limit too, so only the peer error's
    # deadline (1.5 of node-2's 0.2 s interval after its last report) can make it look.
    h = await start_detector(sqlite_url, watch_interval_s=3600, hang_check_interval_s=3600, node_lost_after_s=3600)
    await h.place(JOB, [(rank, node, 0) for rank, node in enumerate(NODES)])
    quick = NodeReport(source="node-2", node_id="node-2", interval_s=0.2, gpu_backend="sim")
    await h.report_bytes("node-2", quick.to_bytes())
    await _round(h, ("node-1", "node-3"))
    await h.emit("node-1", _exit("node-1", 0, GLOO_RESET))
    await h.settled()

    async def node_2_lost() -> bool:
        return bool(await h.open_incidents(JOB))

    assert await wait_until(node_2_lost, timeout=15)
    [incident] = await h.open_incidents(JOB)
    assert incident["culprit_node_id"] == "node-2"
    assert incident["root_cause"].startswith("node node-2 lost: its peers' collectives failed")


# Restart in place: a rank that survives its peer's failure parks instead of exiting, and says so with rank.parked.
GLOO_RESET_WHY = GLOO_RESET[-1]  # what reprise_sdk.run says it caught: "<exception type>: <message>"


async def test_a_parked_rank_s_peer_error_and_a_silent_node_make_it_lost_before_the_limit(
    start_detector: StartDetector, sqlite_url: str
) -> None:
    h, clock = await _start(start_detector, sqlite_url)
    parked = _parked("node-1", 0, GLOO_RESET_WHY)  # rank 0 survived node-2's death in place
    incident = await _node_2_lost_early(h, clock, parked)
    assert incident["symptom_count"] == 1  # the lost node: the survivor's parking is evidence, not a symptom
    assert h.symptoms(parked.event_id) == []


async def test_parked_ranks_while_every_node_reports_open_nothing_and_are_not_recorded(
    start_detector: StartDetector, sqlite_url: str
) -> None:
    h, clock = await _start(start_detector, sqlite_url)
    clock.advance(0.5)
    survivors = [_parked("node-1", 0, GLOO_RESET_WHY), _parked("node-3", 2, "restart ordered")]
    for event in survivors:
        await h.emit(event.node_id, event)
    await h.settled()
    for _ in range(4):  # every node reports each second; each look comes 1.2 s after the last reports
        clock.advance(0.7)
        await _round(h, NODES)
        clock.advance(1.2)
        assert await _look(h) == []
    assert [h.symptoms(e.event_id) for e in survivors] == [[], []]
    assert h.runtime.bus.dead_letter_count == 0
    health = {n["node_id"]: n["state"] for n in (await h.client.get("/v1/node-health")).json()["data"]}
    assert set(health.values()) == {"alive"}


# A scheduler ending the step (Slurm: a preemption, a time limit): every rank ends, and so does every agent.
def _ended(node: str, rank: int) -> RankExited:
    event = _exit(node, rank, GLOO_RESET, exit_code=143)
    return event.model_copy(update={"signal": "SIGTERM", "scheduler_ended": True})


async def test_ranks_the_scheduler_ended_open_nothing_and_their_silent_nodes_are_not_lost(
    start_detector: StartDetector, sqlite_url: str
) -> None:
    h, clock = await _start(start_detector, sqlite_url)
    clock.advance(0.5)
    ended = [_ended(node, rank) for rank, node in enumerate(NODES)]
    for event in ended:
        await h.emit(event.node_id, event)
    await h.settled()
    for _ in range(4):  # the agents are gone with the step: no node reports, well past the 5 s limit
        clock.advance(2.0)
        assert await _look(h) == []
    assert [h.symptoms(e.event_id) for e in ended] == [[], [], []]  # evidence of a release, not symptoms
    health = {n["node_id"]: n["state"] for n in (await h.client.get("/v1/node-health")).json()["data"]}
    assert set(health.values()) == {"alive"}

    await _round(h, ("node-1",))  # node-1's agent of the job's next allocation reports: judged as any node again
    clock.advance(6.0)
    [incident] = await _look(h)
    assert (incident["category"], incident["culprit_node_id"]) == ("node", "node-1")
