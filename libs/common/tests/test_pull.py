"""Pull requests on an inbox of our own, against a real nats-server: batches in one wait, nothing lost between
fetches, what was never handed out given back on close, and a deleted consumer reported."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from reprise_cli.servers import NatsServer
from reprise_common.errors import BusError
from reprise_common.pull import EXPIRY_GRACE_S, LOST_LIMIT, PullInbox

STREAM, DURABLE = "PULLTEST", "reader"


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[Client]:
    client = await nats.connect(nats_server.url)
    js = client.jetstream()
    await js.add_stream(StreamConfig(name=STREAM, subjects=["pulltest.>"]))
    await js.add_consumer(STREAM, config=ConsumerConfig(durable_name=DURABLE, ack_policy=AckPolicy.EXPLICIT))
    yield client
    await client.close()


async def _publish(nc: Client, first: int, count: int) -> None:
    js = nc.jetstream()
    for n in range(first, first + count):
        await js.publish(f"pulltest.{n}", str(n).encode(), headers={"Nats-Msg-Id": f"m-{n}"})


async def _inbox(nc: Client) -> PullInbox:
    inbox = PullInbox(nc, stream=STREAM, consumer=DURABLE, pending_msgs=10_000, pending_bytes=1 << 24)
    await inbox.open()
    return inbox


def _numbers(msgs: list[Msg]) -> list[int]:
    return [int(m.data) for m in msgs]


async def test_a_fetch_takes_a_batch_in_order_and_times_out_when_nothing_is_pending(nc: Client) -> None:
    await _publish(nc, 0, 10)
    inbox = await _inbox(nc)
    first = await inbox.fetch(4, timeout=2, linger=0.05)
    rest = await inbox.fetch(100, timeout=2, linger=0.05)
    assert _numbers(first) == [0, 1, 2, 3] and _numbers(rest) == list(range(4, 10))
    for msg in first + rest:
        await msg.ack()
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeoutError):
        await inbox.fetch(100, timeout=0.3, linger=0.05)
    assert 0.25 <= loop.time() - started < 2.0
    await inbox.close()


async def test_messages_arriving_after_a_fetch_returned_come_with_the_next_and_are_given_back_on_close(
    nc: Client,
) -> None:
    await _publish(nc, 0, 3)
    inbox = await _inbox(nc)
    assert _numbers(await inbox.fetch(10, timeout=2, linger=0.05)) == [0, 1, 2]  # the request stays open for 7 more
    await _publish(nc, 3, 5)
    later = await inbox.fetch(2, timeout=2, linger=0.05)
    assert _numbers(later) == [3, 4]
    await asyncio.sleep(0.2)  # 5, 6 and 7 have arrived on the open request by now, not handed out
    await inbox.close()

    again = await _inbox(nc)
    redelivered = await again.fetch(10, timeout=2, linger=0.05)  # at once, not after the ack wait (30 s)
    assert sorted(_numbers(redelivered)) == [5, 6, 7]  # given back together; redelivered in any order
    assert [m.metadata.num_delivered for m in redelivered] == [2, 2, 2]
    await again.close()


async def test_a_deleted_consumer_is_an_error_not_a_silent_wait(nc: Client) -> None:
    inbox = await _inbox(nc)
    waiting = asyncio.create_task(inbox.fetch(10, timeout=10, linger=0.05))
    await asyncio.sleep(0.2)
    await nc.jetstream().delete_consumer(STREAM, DURABLE)
    with pytest.raises(BusError, match="refused"):
        await asyncio.wait_for(waiting, 5)
    await inbox.close()


async def test_requests_that_go_unanswered_are_an_error_not_an_endless_wait(nc: Client) -> None:
    """A request whose end never comes was lost (after a cluster member's restart, every later one was too): after
    LOST_LIMIT of them the fetch fails, so the consumer subscribes again instead of waiting for good."""
    inbox = await _inbox(nc)
    inbox.next_subject = "pulltest-black.hole"  # requests that reach no consumer: no messages, no status

    async def swallow(_msg: Msg) -> None:  # a subscriber that never answers (else the server says no responders)
        return None

    await nc.subscribe(inbox.next_subject, cb=swallow)
    refused = None
    for _ in range(LOST_LIMIT + 2):
        try:
            await inbox.fetch(10, timeout=0.1, linger=0.05)
        except TimeoutError:
            await asyncio.sleep(EXPIRY_GRACE_S + 0.2)  # the request is given up once its grace has passed
        except BusError as exc:
            refused = exc
            break
    assert refused is not None and "unanswered" in str(refused)
    await inbox.close()


async def test_requests_answered_by_their_expiry_are_no_loss(nc: Client) -> None:
    inbox = await _inbox(nc)
    for _ in range(LOST_LIMIT + 2):  # nothing pending: each request ends with a 408 when it expires
        with pytest.raises(TimeoutError):
            await inbox.fetch(10, timeout=0.1, linger=0.05)
        await asyncio.sleep(EXPIRY_GRACE_S + 0.2)
    await _publish(nc, 0, 3)
    assert _numbers(await inbox.fetch(10, timeout=2, linger=0.05)) == [0, 1, 2]
    await inbox.close()
