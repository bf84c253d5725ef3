"""The batch consumer against a real nats-server: the next batch is fetched while one is handled, and given back
at once when the consumer stops before handling it; where a message came from is read from its ack subject."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import nats.errors
import pytest
from nats.aio.msg import Msg

from reprise_cli.servers import NatsServer
from reprise_common import subjects
from reprise_common.aio import poll_until
from reprise_common.bus import Bus
from reprise_common.consumer import (
    ACK,
    BatchHandler,
    Consumer,
    Delivery,
    Item,
    Outcome,
    Verdict,
    delivery_of,
    side_by_side,
)
from reprise_common.events import GpuXid


async def _ack_pending(bus: Bus, durable: str, count: int) -> bool:
    for _ in range(500):
        if (await bus.js.consumer_info("AGENT", durable)).num_ack_pending == count:
            return True
        await asyncio.sleep(0.02)
    return False


async def test_the_batch_fetched_ahead_is_given_back_at_once_when_the_consumer_stops(nats_server: NatsServer) -> None:
    bus = Bus(url=nats_server.url, service="test")
    await bus.connect(attempts=5)
    events = [GpuXid(source="node-1", node_id="node-1", gpu=gpu, xid=48) for gpu in range(4)]
    for event in events:
        await bus.publish(subjects.node_event("node-1", event.type), event)
    ids = [event.event_id for event in events]
    release = asyncio.Event()
    first_seen: list[str] = []
    second_seen: list[tuple[str, int]] = []

    async def slow(items: list[Item]) -> list[Verdict]:
        first_seen.extend(item.event.event_id for item in items if item.event is not None)
        await release.wait()
        return [ACK] * len(items)

    async def record(items: list[Item]) -> list[Verdict]:
        second_seen.extend((i.event.event_id, i.delivery.num_delivered) for i in items if i.event is not None)
        return [ACK] * len(items)

    def consumer(handler: BatchHandler, batch: int) -> Consumer:
        # an ack wait far beyond the test's patience: only a message given back can come again in time
        return bus.batch_consumer(
            stream="AGENT",
            durable="t",
            filter_subject=subjects.AGENT_EVENTS,
            handler=handler,
            batch=batch,
            prefetch=True,
            ack_wait_s=120,
        )

    first = consumer(slow, batch=2)
    await first.open()
    # While the first batch is in the handler, the next one is fetched: all four are out, none acknowledged.
    assert await _ack_pending(bus, "t", 4)
    assert first_seen == ids[:2]

    stopping = asyncio.create_task(first.stop())
    release.set()
    await stopping
    assert first.acked == 2 and first_seen == ids[:2]  # the batch fetched ahead was never handled here

    second = consumer(record, batch=10)
    await second.open()
    assert await poll_until(lambda: len(second_seen) == 2, timeout_s=10)
    assert second_seen == [(ids[2], 2), (ids[3], 2)]  # delivered a second time, each once
    await second.stop()
    await bus.close()


def test_a_delivery_is_read_from_the_ack_subject_as_nats_py_reads_it() -> None:
    replies = [
        "$JS.ACK.AGENT.detector-events.3.12345.678.1764489012345678901.42",  # without domain and account
        "$JS.ACK.hub.ACCHASH.AGENT.detector-events.2.999.17.1764489012345678901.0.rand0m",  # with them
        "$JS.ACK._.ACCHASH.AGENT.detector-events.1.5.5.1764489012345678901.0",  # no domain, no trailing token
    ]
    for reply in replies:
        msg = Msg(_client=None, subject="reprise.agent.node-1.gpu.xid", reply=reply, data=b"{}")  # type: ignore[arg-type]
        meta = msg.metadata
        delivery = delivery_of(msg)
        assert replace(delivery, stored_ns=0) == Delivery(msg.subject, meta.num_delivered, meta.sequence.stream)
        assert abs(delivery.stored_ns - 1764489012345678901) < 1000  # when the stream stored it, to the microsecond
    with pytest.raises(nats.errors.Error):  # not a JetStream message
        delivery_of(Msg(_client=None, subject="x", reply="_INBOX.abc", data=b""))  # type: ignore[arg-type]


async def test_side_by_side_handles_keys_at_once_and_each_key_in_order() -> None:
    events = [GpuXid(source=node, node_id=node, gpu=gpu, xid=48) for node, gpu in
              [("a", 0), ("b", 0), ("a", 1), ("c", 0), ("b", 1), ("a", 2)]]  # fmt: skip
    items = [Item(event=e, delivery=Delivery("s", 1, n), data=b"") for n, e in enumerate(events)]
    running: dict[str, int] = {}
    most = 0
    order: list[tuple[str, int]] = []

    async def handle(event: object, delivery: Delivery) -> Outcome:
        nonlocal most
        assert isinstance(event, GpuXid)
        running[event.node_id] = running.get(event.node_id, 0) + 1
        most = max(most, sum(running.values()))
        assert running[event.node_id] == 1, f"two events of {event.node_id} at once"
        await asyncio.sleep(0.01)
        order.append((event.node_id, event.gpu))
        running[event.node_id] -= 1
        if event.gpu == 1 and event.node_id == "b":
            raise RuntimeError("a handler bug")
        return Outcome.ACK

    verdicts = await side_by_side(handle, key=lambda e: e.node_id if isinstance(e, GpuXid) else "")(items)
    assert most == 3  # a, b and c together
    assert [gpu for node, gpu in order if node == "a"] == [0, 1, 2]  # one key in order
    assert [v.outcome for v in verdicts] == [Outcome.ACK] * 4 + [Outcome.RETRY, Outcome.ACK]  # in the batch's order
    assert "handler error" in verdicts[4].reason
