"""A rank killed from outside is a fault whatever its log says: one that survived a peer's failure in place keeps that
failure's lines in its log tail, and its later SIGKILL must still open an incident (it was taken for a peer's victim,
a secondary symptom, and the job ran a rank short with no incident at all)."""

from __future__ import annotations

from reprise_common.events import RankExited

from .conftest import Harness

JOB = "job-k"
SURVIVED = [
    "step 20 loss 0.41",
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:4711",
    "reprise: parked after a peer failure; resuming in epoch 2",
    "step 24 loss 0.39",
    "step 28 loss 0.37",
]


async def test_a_rank_killed_after_surviving_a_peer_failure_opens_an_incident(detector: Harness) -> None:
    await detector.place(JOB, [(0, "node-1", 0), (1, "node-2", 0)], epoch=2)
    killed = RankExited(
        source="node-1", node_id="node-1", job_id=JOB, rank=0, signal="SIGKILL", log_tail=SURVIVED, restart_epoch=2
    )
    await detector.emit("node-1", killed)
    await detector.settled()
    [incident] = await detector.open_incidents(JOB)
    assert (incident["category"], incident["culprit_node_id"], incident["culprit_rank"]) == (
        "process_killed",
        "node-1",
        0,
    )
    assert incident["root_cause"] == "rank 0 was killed (SIGKILL, not by the OOM killer)"
