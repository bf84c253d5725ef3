"""Partitions a node must ride out: its management link (agent to NATS) cut for a few seconds, both ways or one way,
while its ranks keep training with their peers over the data link; and its data link cut for 2 s.

What must hold (issue 39): no node-loss incident and no recovery; the job keeps training at the same epoch through
the cut (rank 0 on the other host keeps stepping, which a data-parallel job cannot do without node-2's rank); the
node's agent reports its rank again once the link is back. A data cut shorter than the job's hang limit stalls the
ranks (which shows they train over that link) and nothing more: the same epoch trains on once it heals. Longer
cuts (10 s, 60 s) are in test_long_cuts.py (`make chaos`).
"""

from __future__ import annotations

import pytest

from reprise_cli.netns import Direction, Link

from .harness import SETTLE_S, PartitionedJob, ride_out, sleep_watching

pytestmark = [pytest.mark.stack, pytest.mark.timeout(600)]


def rides_out_unnoticed(job: PartitionedJob, *, seconds: float, direction: Direction = Direction.BOTH) -> None:
    """A cut shorter than the report limit: nothing to say, nothing to recover, the same epoch training on."""
    seen = ride_out(job, seconds=seconds, direction=direction)
    assert not seen.incidents, [(i["category"], i["root_cause"]) for i in seen.incidents]
    assert seen.recoveries == 0, job.recoveries()[0]["detail"]
    assert (job.job()["state"], job.job()["restart_epoch"]) == ("running", 0)
    assert seen.trained_through() and seen.back is not None, seen


@pytest.mark.parametrize("seconds", [1.0, 3.0])
def test_management_cut_while_training_is_no_node_loss(training: PartitionedJob, seconds: float) -> None:
    rides_out_unnoticed(training, seconds=seconds)


@pytest.mark.parametrize("direction", [Direction.OUT, Direction.IN])
def test_one_way_management_cut_is_no_node_loss(training: PartitionedJob, direction: Direction) -> None:
    """OUT: the agent's reports and pongs are lost, the server's pings reach it; IN: the reverse (its reports reach
    the server, which never hears an acknowledgement of its own sends)."""
    rides_out_unnoticed(training, seconds=3.0, direction=direction)


def test_data_link_cut_stalls_the_ranks_and_training_resumes(training: PartitionedJob) -> None:
    incidents, recoveries = len(training.incidents()), len(training.recoveries())
    first = training.step("node-1")
    assert first is not None
    training.network.cut("node-2", links=(Link.DATA,))
    try:
        during = sleep_watching(training, 2.0, "node-1")
    finally:
        training.network.heal("node-2")
    after = sleep_watching(training, SETTLE_S, "node-1")
    print(f"data cut 2 s: node-1 steps {first} -> {during} during, {after[-1]} {SETTLE_S:g} s after")
    assert max(s or 0 for s in during) <= first + 2  # the step in flight at most: the ranks need the data link
    assert after[-1] is not None and after[-1] > max(s or 0 for s in during)
    assert (len(training.incidents()), len(training.recoveries())) == (incidents, recoveries)
    assert training.job()["restart_epoch"] == 0
