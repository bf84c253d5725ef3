"""What the agents backend sends the nodes, read by agents on a real NATS server that record their commands.

- A stop for a hang: every node's ranks' stacks are captured before any node is told to stop. A rank stopped on one
  node ends its peers' collective on the others; a node whose capture came after that read a stack in torch's
  exception hook instead of the collective it hung in (a CI run of tests/test_stack.py).
- A containerized job's launch: only the spares a recovery would take first are told to keep its standby containers,
  and only once the launch's ranks train (or after a bound, for ranks that report no step).
"""

from __future__ import annotations

import asyncio
import time

from reprise_cli.servers import NatsServer
from reprise_common import subjects
from reprise_common.aio import poll_until
from reprise_common.bus import Bus
from reprise_common.clock import SystemClock
from reprise_common.events import (
    CaptureStacksCommand,
    CaptureStacksData,
    CaptureStacksReply,
    CommandResult,
    ContainerSupport,
    GpuStatus,
    LaunchArgs,
    LaunchReply,
    NodeReport,
    PrepareStandbysCommand,
    PrepareStandbysReply,
    RankStatus,
    StopCommand,
    StopReply,
    Wire,
    parse_command,
)
from reprise_orchestrator.compute.agents.backend import AgentsBackend
from reprise_orchestrator.compute.backend import LaunchRequest
from reprise_orchestrator.inventory import Inventory

SLOW_CAPTURE_S = 0.5


async def test_a_hangs_stop_reaches_no_node_before_every_node_has_captured_its_stacks(nats_server: NatsServer) -> None:
    seen: list[tuple[str, str, float]] = []  # (node, what, when): a command received, or a capture answered

    def agent(node_id: str, capture_s: float):  # type: ignore[no-untyped-def]
        async def on_command(data: bytes) -> Wire:
            command = parse_command(data)
            seen.append((node_id, command.action.value, time.monotonic()))
            done = {"command_id": command.command_id, "node_id": node_id, "result": CommandResult.DONE}
            if isinstance(command, CaptureStacksCommand):
                assert command.args.incident_id == "inc-hang" and command.fence == 3
                await asyncio.sleep(capture_s)
                seen.append((node_id, "captured", time.monotonic()))
                return CaptureStacksReply(**done, data=CaptureStacksData(captured=[0]))
            assert isinstance(command, StopCommand)
            return StopReply(**done)

        return on_command

    bus = Bus(url=nats_server.url, service="test-orchestrator", provision=False)
    await bus.connect(attempts=5)
    inventory = Inventory(clock=SystemClock(), stale_s=30.0)
    backend = AgentsBackend(bus=bus, inventory=inventory, command_timeout_s=5.0, stop_grace_s=0.5)
    try:
        await bus.serve(subjects.node_command("w-1"), agent("w-1", 0.0))
        await bus.serve(subjects.node_command("w-2"), agent("w-2", SLOW_CAPTURE_S))
        answers = await backend.stop("job-a", ["w-1", "w-2"], operation_id="op-1", fence=3, stacks_for="inc-hang")
        assert [(a.node_id, a.ok) for a in answers.items] == [("w-1", True), ("w-2", True)]
        slow_done = next(when for node, what, when in seen if (node, what) == ("w-2", "captured"))
        stops = [(node, when) for node, what, when in seen if what == "stop"]
        assert sorted(node for node, _ in stops) == ["w-1", "w-2"], seen
        assert all(when >= slow_done for _, when in stops), seen  # w-1's ranks ran on while w-2 read its stacks
        assert [what for node, what, _ in seen if node == "w-1"] == ["capture_stacks", "captured", "stop"]

        seen.clear()
        await backend.stop("job-a", ["w-1", "w-2"], operation_id="op-2", fence=3)  # not a hang: no capture
        assert sorted((node, what) for node, what, _ in seen) == [("w-1", "stop"), ("w-2", "stop")]
    finally:
        await bus.close()


async def test_a_containerized_launch_tells_only_the_spares_a_recovery_takes_first_to_keep_standbys(
    nats_server: NatsServer,
) -> None:
    told: list[tuple[str, str]] = []  # (node, action)

    def agent(node_id: str):  # type: ignore[no-untyped-def]
        async def on_command(data: bytes) -> Wire:
            command = parse_command(data)
            told.append((node_id, command.action.value))
            done = {"command_id": command.command_id, "node_id": node_id, "result": CommandResult.DONE}
            if isinstance(command, PrepareStandbysCommand):
                return PrepareStandbysReply(**done)
            return LaunchReply(**done)

        return on_command

    def report(node_id: str, *, spare: bool, ranks: list[RankStatus] | None = None) -> NodeReport:
        return NodeReport(
            source=node_id, node_id=node_id, interval_s=1.0, gpu_backend="sim", gpus=[GpuStatus(index=0)],
            spare=spare, containers=ContainerSupport(), ranks=ranks or [],
        )  # fmt: skip

    bus = Bus(url=nats_server.url, service="test-orchestrator", provision=False)
    await bus.connect(attempts=5)
    inventory = Inventory(clock=SystemClock(), stale_s=30.0)
    nodes = {"w-1": False, "s-3": True, "s-1": True, "s-2": True}
    for node_id, spare in nodes.items():
        inventory.observe(node_id, report(node_id, spare=spare))
    backend = AgentsBackend(
        bus=bus, inventory=inventory, command_timeout_s=5.0, stop_grace_s=0.5, standby_spares=2, prepare_wait_s=30.0
    )
    try:
        for node_id in nodes:
            await bus.serve(subjects.node_command(node_id), agent(node_id))
        args = LaunchArgs.model_validate({
            "restart_epoch": 0, "world_size": 1, "master_addr": "w-1", "master_port": 29500,
            "command": ["python", "train.py"], "container": {"image": "reprise-base:local"},
            "ranks": [{"rank": 0, "node_id": "w-1", "local_rank": 0}],
        })  # fmt: skip
        answers = await backend.launch(LaunchRequest("job-a", args), operation_id="op-1", fence=1)
        assert [a.node_id for a in answers.items] == ["w-1"]
        await asyncio.sleep(0.5)
        assert told == [("w-1", "launch")]  # its rank does not train yet: no spare is told
        trains = RankStatus(job_id="job-a", rank=0, restart_epoch=0, step=1)
        inventory.observe("w-1", report("w-1", spare=False, ranks=[trains]))
        assert await poll_until(lambda: len(told) == 3, timeout_s=10), told
        await asyncio.sleep(0.3)  # nothing more comes
        assert sorted(told) == [("s-1", "prepare_standbys"), ("s-2", "prepare_standbys"), ("w-1", "launch")]

        told.clear()
        backend.prepare_wait_s = 0.5  # its rank reports no step: the spares are told after this
        await backend.launch(LaunchRequest("job-b", args), operation_id="op-2", fence=1)
        backend.standby_spares = 0  # none: a launch tells no spare
        await backend.launch(LaunchRequest("job-c", args), operation_id="op-3", fence=1)
        await asyncio.sleep(1.5)
        assert sorted(told) == [
            ("s-1", "prepare_standbys"), ("s-2", "prepare_standbys"), ("w-1", "launch"), ("w-1", "launch")
        ]  # fmt: skip

        told.clear()  # a recovery cordoned s-1 (an XID 79 there): its GPUs may look fine again, it takes no ranks
        backend.standby_spares = 2
        await backend.cordon("s-1", reason="XID 79")
        await backend.launch(LaunchRequest("job-d", args), operation_id="op-4", fence=1)
        assert await poll_until(lambda: len(told) == 3, timeout_s=10), told
        assert sorted(told) == [("s-2", "prepare_standbys"), ("s-3", "prepare_standbys"), ("w-1", "launch")]
        assert "s-1" not in backend.pool().spares
        await backend.uncordon("s-1")
        assert "s-1" in backend.pool().spares
    finally:
        await backend.close()
        await bus.close()
