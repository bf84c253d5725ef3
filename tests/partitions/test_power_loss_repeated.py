"""Power losses in a row (`make chaos` only): REPRISE_CHAOS_POWER_CUTS times (20 by default), a fresh job trains on
node-1 and node-2, then node-2 falls silent on both links; each time, the time from the cut to the node-loss incident.

What must hold (issue 39): every cut gives one node-loss incident naming node-2, and the median time to it is at
most 2 s. Between cuts the job is cancelled once recovered, node-2 is healed, whatever rank of an old job it still
runs is killed (test_power_loss.py is the case about fencing those) and it is uncordoned.
"""

from __future__ import annotations

import os
import signal
import statistics

import pytest

from reprise_cli.client import poll
from reprise_cli.netns import Link, NamespacedStack
from reprise_cli.servers import answers
from reprise_cli.topology import agent_name

from .harness import PartitionedJob, now, since, submit_training

pytestmark = [pytest.mark.stack, pytest.mark.chaos, pytest.mark.timeout(3600)]

CUTS = int(os.environ.get("REPRISE_CHAOS_POWER_CUTS", "20"))
TARGET_MEDIAN_S = 2.0


def lose_node_2(job: PartitionedJob) -> float:
    """Cut node-2's power, as far as the network can tell; seconds until its node-loss incident opened."""
    cut_at = now()
    job.network.cut("node-2", links=tuple(Link))
    losses = poll(job.node_losses, bool, timeout_s=60)
    assert [i["culprit_node_id"] for i in losses] == ["node-2"], job.incidents()
    recoveries = poll(job.recoveries, lambda r: bool(r) and r[0]["outcome"] is not None, timeout_s=120)
    assert recoveries and recoveries[0]["outcome"] is not None, recoveries
    return since(cut_at, losses[-1]["opened_at"])


def give_back_node_2(job: PartitionedJob) -> None:
    """Heal node-2, kill what its agent still runs of the job, uncordon it, and wait until it can be placed."""
    job.network.heal("node-2")
    ranks = poll(lambda: job.ranks("node-2"), lambda ranks: ranks is not None, timeout_s=15)
    for rank in ranks or []:  # a rank of this test's job, on this machine: its process
        os.kill(int(rank["pid"]), signal.SIGKILL)
    if next(n for n in job.client.nodes() if n["node_id"] == "node-2")["cordoned"]:
        job.client.uncordon("node-2")

    def placeable(nodes: list[dict[str, object]]) -> bool:
        return any(n["node_id"] == "node-2" and not n["stale"] and not n["cordoned"] for n in nodes)

    assert placeable(poll(job.client.nodes, placeable, timeout_s=30))
    # Its agent back on NATS too: the inventory has called it placeable before that, and a launch it cannot hear left
    # the next job's rank 0 waiting at the rendezvous (docs/reliability.md, "Partitions on separate hosts").
    ready = job.stack.url(agent_name("node-2")) + "/readyz"
    assert poll(lambda: answers(ready), bool, timeout_s=30), f"node-2's agent not back on NATS: {ready}"


def test_power_loss_median_time_to_node_loss(
    partitioned_stack: NamespacedStack, tmp_path_factory: pytest.TempPathFactory
) -> None:
    times: list[float] = []
    for cut in range(CUTS):
        job = submit_training(partitioned_stack, tmp_path_factory.mktemp(f"job-{cut}"))
        try:
            times.append(lose_node_2(job))
            job.client.cancel(job.job_id)
            give_back_node_2(job)
        finally:
            job.network.heal("node-2")
            job.close()
        print(f"power loss {cut + 1} of {CUTS}: node loss after {times[-1]:.2f} s")
    median = statistics.median(times)
    print(f"power loss x{CUTS}: median {median:.2f} s, min {min(times):.2f} s, max {max(times):.2f} s")
    assert median <= TARGET_MEDIAN_S, sorted(times)
