"""The bus against a real nats-server: streams, dedup, consumers, dead letters, reconnects."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from reprise_cli.servers import NatsServer
from reprise_common import subjects
from reprise_common.aio import poll_until
from reprise_common.bus import Bus, Delivery, Outcome
from reprise_common.errors import MalformedEventError
from reprise_common.events import DeadLetter, Event, GpuXid, NodeReport, parse_event


async def _wait_for(predicate: Callable[[], object], timeout: float = 10.0) -> bool:
    return await poll_until(predicate, timeout_s=timeout)


async def test_streams_are_provisioned_idempotently(nats_server: NatsServer) -> None:
    bus = Bus(url=nats_server.url, service="test")
    await bus.connect(attempts=5)
    await bus.ensure_streams()  # a second time changes nothing and raises nothing
    names = {info.config.name for info in await bus.js.streams_info()}
    assert {"AGENT", "INCIDENTS", "PLACEMENTS", "RECOVERIES", "DEADLETTER"} <= names
    await bus.close()


async def test_publish_with_same_event_id_is_stored_once(nats_server: NatsServer) -> None:
    bus = Bus(url=nats_server.url, service="test")
    await bus.connect(attempts=5)
    event = GpuXid(source="node-1", node_id="node-1", gpu=0, xid=79)
    first = await bus.publish(subjects.node_event("node-1", "gpu.xid"), event)
    again = await bus.publish(subjects.node_event("node-1", "gpu.xid"), event)
    assert first == again
    info = await bus.js.stream_info("AGENT")
    assert info.state.messages == 1
    await bus.close()


async def test_malformed_message_is_dead_lettered_and_consumer_keeps_going(nats_server: NatsServer) -> None:
    bus = Bus(url=nats_server.url, service="test")
    await bus.connect(attempts=5)
    seen: list[Event] = []

    async def handle(event: Event, delivery: Delivery) -> Outcome:
        seen.append(event)
        return Outcome.ACK

    bus.consumer(stream="AGENT", durable="t", filter_subject=subjects.AGENT_EVENTS, handler=handle).start()
    await bus.js.publish(subjects.node_event("node-1", "gpu.xid"), b"{not json")
    await bus.js.publish(subjects.node_event("node-1", "gpu.xid"), b'{"type": "gpu.xid", "gpu": -1}')
    await bus.publish(subjects.node_event("node-1", "gpu.xid"), GpuXid(source="n", node_id="node-1", gpu=1, xid=48))
    assert await _wait_for(lambda: len(seen) == 1 and bus.dead_letter_count == 2)
    assert isinstance(seen[0], GpuXid) and seen[0].xid == 48
    letters = await bus.js.stream_info("DEADLETTER")
    assert letters.state.messages == 2
    await bus.close()


async def test_retry_is_redelivered_then_dead_lettered(nats_server: NatsServer) -> None:
    bus = Bus(url=nats_server.url, service="test")
    await bus.connect(attempts=5)
    deliveries: list[int] = []

    async def always_fail(event: Event, delivery: Delivery) -> Outcome:
        deliveries.append(delivery.num_delivered)
        return Outcome.RETRY

    bus.consumer(
        stream="AGENT", durable="r", filter_subject=subjects.AGENT_EVENTS, handler=always_fail, max_deliver=3,
        retry_delay_s=0.05,
    ).start()  # fmt: skip
    await bus.publish(subjects.node_event("node-2", "gpu.xid"), GpuXid(source="n", node_id="node-2", gpu=0, xid=79))
    assert await _wait_for(lambda: bus.dead_letter_count == 1)
    assert deliveries == [1, 2, 3]
    await bus.close()


async def test_consumer_resumes_after_server_restart(nats_server: NatsServer) -> None:
    bus = Bus(url=nats_server.url, service="test")
    await bus.connect(attempts=5)
    seen: list[str] = []

    async def handle(event: Event, delivery: Delivery) -> Outcome:
        seen.append(event.event_id)
        return Outcome.ACK

    bus.consumer(stream="AGENT", durable="c", filter_subject=subjects.AGENT_REPORTS, handler=handle).start()
    report = NodeReport(source="node-1", node_id="node-1", interval_s=1.0, gpu_backend="sim")
    await bus.publish(subjects.node_report("node-1"), report)
    assert await _wait_for(lambda: len(seen) == 1)

    await asyncio.to_thread(nats_server.stop)
    assert await _wait_for(lambda: not bus.connected)
    await asyncio.to_thread(nats_server.start)
    assert await _wait_for(lambda: bus.connected, timeout=15)

    later = NodeReport(source="node-1", node_id="node-1", interval_s=1.0, gpu_backend="sim")
    await bus.publish(subjects.node_report("node-1"), later)
    assert await _wait_for(lambda: later.event_id in seen, timeout=15)
    await bus.close()


async def test_handler_can_reject_with_a_reason(nats_server: NatsServer) -> None:
    bus = Bus(url=nats_server.url, service="test")
    await bus.connect(attempts=5)

    async def refuse(event: Event, delivery: Delivery) -> Outcome:
        raise MalformedEventError("job id missing")

    bus.consumer(stream="AGENT", durable="x", filter_subject=subjects.AGENT_EVENTS, handler=refuse).start()
    await bus.publish(subjects.node_event("node-3", "gpu.xid"), GpuXid(source="n", node_id="node-3", gpu=0, xid=79))
    assert await _wait_for(lambda: bus.dead_letter_count == 1)
    sub = await bus.js.pull_subscribe(subjects.DEAD_LETTERS_ALL, durable="read", stream="DEADLETTER")
    [msg] = await sub.fetch(1, timeout=5)
    letter = parse_event(msg.data)
    assert isinstance(letter, DeadLetter)
    assert letter.reason == "unusable: job id missing" and letter.original_subject.endswith("node-3.event.gpu.xid")
    await bus.close()
