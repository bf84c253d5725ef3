"""The demo's scenario on Slurm, smaller: the whole platform with a local Slurm cluster of 3 nodes, the job in one
allocation of 2 nodes + 1 spare whose agents srun started, the real DDP script, a crash, an XID 79 and a node loss.

The same code as `reprise demo --scheduler slurm`: each fault is recovered without help; the XID's node is drained in
Slurm with the incident in its reason and the spare takes its place; the lost node (its agent and its slurmd killed) is
seen by Reprise first, the job shrinks, and Slurm marks the node down later while the allocation runs on; the job ends
with the fault-free reference's parameters, bit for bit.
"""

from __future__ import annotations

from contextlib import closing
from pathlib import Path

import pytest

from reprise_cli.demo.models import Fault, FaultPlan
from reprise_cli.demo.report import fault_numbers
from reprise_cli.demo.scenario import Scenario
from reprise_cli.demo.slurm_view import SlurmView
from reprise_cli.demo.training import Training

from .demo_checks import assert_recovered, demo_config, demo_stack

pytest.importorskip("torch", reason="PyTorch is not installed: the DDP demo job cannot run")
pytestmark = [pytest.mark.stack, pytest.mark.chaos, pytest.mark.timeout(360)]


def test_on_slurm_a_ddp_job_survives_a_crash_an_xid79_and_a_node_loss_with_the_reference_parameters(
    slurm_state_dir: Path,
) -> None:
    config = demo_config(slurm_state_dir / "state", scheduler="slurm")
    training = Training(steps=72, checkpoint_every=8, step_sleep=0.1)
    faults = [Fault.RANK_CRASH, Fault.XID79, Fault.NODE_LOSS]
    with demo_stack(config, training, slurm_state_dir / "reference") as demo:
        assert demo.stack.slurm is not None
        with closing(demo.stack.client()) as client:
            scenario = Scenario(demo.stack, client, training, say=print, work_dir=slurm_state_dir / "job")
            scenario.slurm = SlurmView(demo.stack.slurm)
            scenario.slurm.start()
            try:
                run = scenario.run([FaultPlan(fault, rank=1) for fault in faults], reference=demo.reference)
            finally:
                scenario.slurm.stop()

    assert_recovered(run, faults)
    assert run.job["backend"] == "slurm"
    crash, xid, loss = run.faults
    assert xid.incident is not None and loss.incident is not None
    # The XID's node drained in Slurm for that incident; the allocation's spare took its place.
    assert xid.incident["id"] in xid.slurm["reason"] and xid.slurm["reason"].startswith("reprise: incident")
    assert (xid.step("isolating") or {})["data"]["cordoned"] == xid.node_id
    placing = (xid.step("placing") or {})["data"]
    assert placing["decision"] == "spares" and list(placing["replaced"]) == [xid.node_id]
    # The lost node: Reprise's incident first, the job shrunk to the node left; Slurm found out later.
    assert loss.incident["category"] == "node"
    assert (loss.step("placing") or {})["data"]["decision"] == "shrink"
    numbers = fault_numbers(loss, run.samples)
    assert numbers.detection_s is not None and "down_s" in loss.slurm, loss.slurm
    assert numbers.detection_s < loss.slurm["down_s"]
    assert len(run.job["placement"]) == 1 and loss.node_id not in {r["node_id"] for r in run.job["placement"]}
    assert not run.unplanned, run.unplanned  # Slurm's own signals about the lost node opened no second recovery
    assert crash.incident is not None and crash.incident["culprit_rank"] == 1
    assert run.digest == run.reference.digest  # bit for bit, after three restarts, a move to the spare and a shrink
    assert run.ok
