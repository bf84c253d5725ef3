"""The agents backend's stop for a hang: every node's ranks' stacks are captured before any node is told to stop.

A rank stopped on one node ends its peers' collective on the others; a node whose capture came after that read a
stack in torch's exception hook instead of the collective it hung in (a CI run of tests/test_stack.py). Two agents on
a real NATS server stand in for the nodes, one of them slow to capture.
"""

from __future__ import annotations

import asyncio
import time

from reprise_cli.servers import NatsServer
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.clock import SystemClock
from reprise_common.events import (
    CaptureStacksCommand,
    CaptureStacksData,
    CaptureStacksReply,
    CommandResult,
    StopCommand,
    StopReply,
    Wire,
    parse_command,
)
from reprise_orchestrator.compute.agents.backend import AgentsBackend
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
