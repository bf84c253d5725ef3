"""node-2 falls silent on both links at once, as a host does when it loses power: nothing closes (no FIN, no reset),
its agent and rank simply stop being heard. Then the partition heals after the job was recovered without it.

What must hold (issue 39):
- one node-loss incident naming node-2, opened within BOUND_S of the cut (the target is a median of 2 s over 20 cuts,
  test_power_loss_repeated.py; one cut here gets a margin over it), and no competing incident; the job recovered onto
  the spare;
- when node-2 returns, its old rank (still running: its agent never heard of the recovery) is stopped by its agent
  once the new fence reaches it (it ends by a signal, within FENCE_S); it registers no checkpoint and no heartbeat
  into the new epoch; nothing new is opened or recovered because of it.
The cases run in order on one stack; the second also works alone (it cuts node-2 itself).
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

import pytest

from reprise_cli.client import poll, step_seconds
from reprise_cli.netns import Link

from .harness import PartitionedJob, now, since, sleep_watching

pytestmark = [pytest.mark.stack, pytest.mark.timeout(600)]

BOUND_S = 3.0  # one cut's time to its incident: the 2 s target plus one sample's margin
FENCE_S = 15.0  # from the heal until node-2 runs no rank of the job (its agent reconnects and hears the new fence)
SETTLE_S = 7.0  # longer than the detector's 5 s report limit: what the returning node causes shows by then
CUT: dict[str, datetime] = {}  # when the first case cut node-2 (the second heals it)


def recovered(job: PartitionedJob) -> dict[str, Any]:
    """The job's newest recovery once it finished, checked to have recovered."""
    finished = poll(job.recoveries, lambda r: bool(r) and r[0]["outcome"] is not None, timeout_s=120)
    assert finished and finished[0]["outcome"] is not None, f"no finished recovery in 120 s: {finished}"
    assert finished[0]["outcome"] == "recovered", finished[0]["detail"]
    return finished[0]


def test_power_loss_is_one_node_loss_within_the_bound(training: PartitionedJob) -> None:
    CUT["at"] = cut_at = now()
    training.network.cut("node-2", links=tuple(Link))
    losses = poll(training.node_losses, bool, timeout_s=60)
    assert losses, f"no node-loss incident 60 s after node-2 lost power: {training.incidents()}"
    noticed_s = since(cut_at, losses[-1]["opened_at"])
    recovery = recovered(training)
    job = training.job()
    print(
        f"power loss of node-2: node-loss incident {noticed_s:.2f} s after the cut ({losses[-1]['root_cause']!r}); "
        f"recovered at epoch {job['restart_epoch']} {since(cut_at, recovery['finished_at']):.1f} s after the cut; "
        f"steps {[(s['step'], step_seconds(s)) for s in recovery['steps']]}"
    )
    assert [(i["category"], i["culprit_node_id"]) for i in training.incidents()] == [("node", "node-2")]
    assert "node-2" not in {r["node_id"] for r in job["placement"]} and job["state"] == "running"
    training.wait_step_beyond("spare-1", 0, timeout_s=120)  # the spare took node-2's rank, and it trains
    assert noticed_s <= BOUND_S, f"node loss called {noticed_s:.2f} s after the power loss (bound {BOUND_S} s)"


def test_healed_host_is_fenced_and_feeds_nothing_into_the_new_epoch(training: PartitionedJob) -> None:
    """The management link comes back first (the data link a little later, as links heal at their own pace): the
    old rank, still hung in its collective, cannot end by itself before its agent hears of the new fence."""
    if "at" not in CUT:  # run alone: lose node-2 first
        CUT["at"] = now()
        training.network.cut("node-2", links=tuple(Link))
    recovered(training)
    epoch = training.job()["restart_epoch"]
    incidents, recoveries = len(training.incidents()), len(training.recoveries())
    training.wait_step_beyond("spare-1", 0, timeout_s=120)

    healed_at, started = now(), time.monotonic()
    training.network.heal("node-2", links=(Link.MANAGEMENT,))
    seen = poll(lambda: training.ranks("node-2"), lambda ranks: ranks is not None, timeout_s=10)
    stale = [r for r in seen or [] if r["restart_epoch"] < epoch]  # what the agent still ran when it came back
    gone = poll(lambda: training.ranks("node-2"), lambda ranks: ranks == [], timeout_s=FENCE_S)
    fenced_s = time.monotonic() - started
    training.network.heal("node-2")
    steps = sleep_watching(training, SETTLE_S, "node-1")
    ended = [(r["rank"], r["restart_epoch"], r["exit_code"]) for r in training.ranks("node-2", alive=False) or []]
    print(
        f"node-2 back: {len(stale)} rank(s) of epoch < {epoch} still running when its agent answered; "
        f"{'none' if gone == [] else gone} left {fenced_s:.1f} s after the heal, ended as (rank, epoch, exit code) "
        f"{ended}; node-1 steps {steps[0]} -> {steps[-1]} in the {SETTLE_S:g} s after"
    )
    assert stale, "node-2's old rank was gone before its agent came back: nothing to fence"
    assert gone == [], f"node-2 still runs its old rank {FENCE_S:g} s after its management link came back"
    assert all(code is not None and code < 0 for _rank, _epoch, code in ended), ended  # stopped by a signal
    new = training.incidents()[: len(training.incidents()) - incidents]
    assert not new, [(i["category"], i["culprit_node_id"], i["root_cause"]) for i in new]
    assert len(training.recoveries()) == recoveries
    job = training.job()
    assert (job["state"], job["restart_epoch"]) == ("running", epoch)
    assert steps[-1] is not None and steps[0] is not None and steps[-1] > steps[0]
    late = [c for c in training.checkpoints() if since(healed_at, c["created_at"]) > 0 and c["restart_epoch"] < epoch]
    assert not late, f"checkpoints of an old epoch registered after the heal: {late}"
    assert not [r for r in training.ranks("node-2", alive=False) or [] if r["restart_epoch"] >= epoch]
