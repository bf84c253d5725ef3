"""The agent's outbox while NATS is away: bounded, oldest dropped and counted, the rest delivered on return."""

from __future__ import annotations

import asyncio

from reprise_agent.outbox import Outbox
from reprise_cli.servers import NatsServer
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.events import GpuXid


async def test_outbox_is_bounded_and_delivers_the_rest_after_an_outage(nats_server: NatsServer) -> None:
    bus = Bus(url=nats_server.url, service="agent-o1")
    await bus.connect(attempts=10)
    outbox = Outbox(bus, capacity=5, retry_s=0.05)
    task = asyncio.create_task(outbox.run())

    await asyncio.to_thread(nats_server.stop)
    events = [GpuXid(source="o1", node_id="o1", gpu=0, xid=xid) for xid in range(8)]
    for event in events:
        outbox.put(subjects.node_event("o1", "gpu.xid"), event)
    assert len(outbox) <= 5
    assert outbox.dropped >= 3  # the oldest went; the count says how many

    await asyncio.to_thread(nats_server.start)
    assert await outbox.flush(timeout_s=20)
    info = await bus.js.stream_info("AGENT")
    stored = info.state.messages
    assert stored == len(events) - outbox.dropped
    task.cancel()
    await bus.close()
