"""What the demo's end-to-end tests (tests/test_demo_*.py) share: the demo's stack made smaller, started beside the
fault-free reference run, and the checks every backend's run of the demo's faults must pass."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reprise_cli.demo.models import DemoRun, Fault, FaultRun
from reprise_cli.demo.report import fault_numbers
from reprise_cli.demo.training import ReferenceRun, Training
from reprise_cli.servers import free_stack_ports
from reprise_cli.stack import Stack
from reprise_cli.topology import DEFAULT_PORTS, StackConfig

DEMO_FAULTS = [Fault.RANK_CRASH, Fault.XID79, Fault.RANK_HANG, Fault.NODE_LOSS]  # demo_faults(), in order


def demo_config(state_dir: Path, **choices: Any) -> StackConfig:
    """The demo's topology, smaller: 2 nodes and a spare with 2 simulated GPUs each, on free ports; `choices` pick the
    scheduler or the runtime."""
    ports = free_stack_ports(DEFAULT_PORTS)
    return StackConfig(nodes=2, spares=1, gpus_per_node=2, state_dir=state_dir, ports=ports, **choices)


@dataclass
class DemoStack:
    """A started stack and the fault-free reference run beside it."""

    stack: Stack
    reference: ReferenceRun


@contextmanager
def demo_stack(config: StackConfig, training: Training, reference_dir: Path) -> Iterator[DemoStack]:
    """The reference run of `training` (2 ranks) started, then the stack; both stopped on the way out."""
    reference = ReferenceRun(training, world_size=2, work_dir=reference_dir).start()
    stack = Stack(config)
    try:
        stack.start(timeout_s=90)
        yield DemoStack(stack, reference)
    finally:
        reference.stop()
        stack.stop()


def assert_recovered(run: DemoRun, faults: list[Fault]) -> None:
    """The faults were injected in this order, each recovered without help; other recoveries are printed (a loaded
    machine sometimes makes one, and it must not hide the faults' own)."""
    assert [f.plan.fault for f in run.faults] == faults
    assert [f.recovered for f in run.faults] == [True] * len(faults), [f.recovery for f in run.faults]
    print("unplanned recoveries:", [(r["id"], r["step"], r.get("outcome")) for r in run.unplanned])


def assert_detected_before_recovered(fault: FaultRun, run: DemoRun) -> None:
    """The fault was detected, then recovered, both after its injection."""
    numbers = fault_numbers(fault, run.samples)
    assert numbers.detection_s is not None and numbers.recovery_s is not None, fault.recovery
    assert 0 < numbers.detection_s < numbers.recovery_s


def assert_demo_faults_recovered(run: DemoRun) -> None:
    """The demo's four faults on 2 nodes and a spare, each recovered: the crash and the hang blamed on rank 1 (on
    node-2), the XID's node replaced by the spare, then the spare lost; the job ended with the reference's parameters,
    bit for bit."""
    assert_recovered(run, DEMO_FAULTS)
    for fault in run.faults:
        assert_detected_before_recovered(fault, run)
    crash, xid, hang, loss = run.faults
    assert crash.incident is not None
    assert (crash.incident["culprit_node_id"], crash.incident["culprit_rank"]) == ("node-2", 1)
    assert (xid.step("placing") or {})["data"]["replaced"] == {"node-2": "spare-1"}
    assert hang.incident is not None and hang.incident["culprit_rank"] == 1
    assert loss.node_id == "spare-1"
    assert run.digest == run.reference.digest
    assert run.ok
