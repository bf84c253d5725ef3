"""A job preempted by Slurm, end to end: the whole platform with a local Slurm cluster whose urgent partition preempts
(requeues) the jobs of the default one. Slurm ends the job's step (its agents and ranks get SIGTERM), requeues the
allocation, and runs it again once the urgent job is over.

What must hold: the one root cause is the preemption (a dependency incident, named by Slurm's signal), not a crash of
the ranks Slurm terminated nor a loss of the nodes whose agents it stopped; no node is cordoned, drained or left out;
the recovery waits for the requeued allocation and brings the job back on it, from its checkpoint.
"""

from __future__ import annotations

import sys
from contextlib import closing
from pathlib import Path

import pytest

from reprise_cli.client import poll
from reprise_cli.stack import Stack
from reprise_cli.topology import StackConfig

pytestmark = [pytest.mark.stack, pytest.mark.timeout(300)]
RANK = "import reprise_sdk, time\nfor step in range(100000):\n    reprise_sdk.heartbeat(step)\n    time.sleep(0.2)\n"


def test_a_preempted_job_is_one_dependency_incident_and_comes_back_on_its_requeued_allocation(
    slurm_state_dir: Path,
) -> None:
    config = StackConfig(nodes=2, spares=0, gpus_per_node=1, state_dir=slurm_state_dir / "state", scheduler="slurm")
    stack = Stack(config, free_ports=True)
    try:
        stack.start(timeout_s=90)
        assert stack.slurm is not None
        with closing(stack.client()) as client:
            job = client.submit(
                {
                    "name": "preempted",
                    "node_count": 2,
                    "ranks_per_node": 1,
                    "command": [sys.executable, "-c", RANK],
                    "policy": {"placement_timeout_s": 120, "backoff_initial_s": 0},
                    "slurm": {"spares": 0, "output": str(slurm_state_dir / "slurm-%j.out")},
                }
            )
            job = poll(lambda: client.job(job["id"]), lambda j: j["state"] != "pending", timeout_s=60)
            assert job["state"] == "running", job
            nodes = sorted(r["node_id"] for r in job["placement"])

            stack.slurm.preempt(nodes=1, seconds=5)  # Slurm requeues our allocation to make room for it

            back = poll(
                lambda: client.job(job["id"]),
                lambda j: j["state"] == "running" and j["restart_epoch"] >= 1,
                timeout_s=120,
                interval_s=0.5,
            )
            incidents = client.incidents(job["id"])
            recoveries = client.recoveries(job["id"])
            node_states = stack.slurm.node_view()
    finally:
        stack.stop()

    assert [(i["category"], "preempted" in i["root_cause"]) for i in incidents] == [("dependency", True)], incidents
    assert [r["outcome"] for r in recoveries] == ["recovered"], recoveries
    steps = {s["step"]: s.get("data") or {} for s in recoveries[0]["steps"]}
    assert not steps["isolating"].get("cordoned") and not steps["isolating"].get("excluded"), steps["isolating"]
    assert sorted(r["node_id"] for r in back["placement"]) == nodes  # the requeued allocation, on the same nodes here
    assert all("drain" not in state for state, _reason in node_states.values()), node_states
