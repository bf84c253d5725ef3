"""A detector that dies with a batch of agent events in hand: another one takes the batch over within seconds."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from nats.js.api import AckPolicy, ConsumerConfig

from reprise_common import subjects
from reprise_common.events import RankExited
from reprise_detector.runtime import EVENTS_DURABLE

# `Harness` and `StartDetector` (tests/conftest.py) are passed in as fixtures; conftest is not importable here.
Harness = Any
StartDetector = Any

OLD_ACK_WAIT_S = 30.0  # what an earlier release created the durable consumer with


async def _held_by_the_detector(h: Harness, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        info = await h.agents.js.consumer_info(subjects.AGENT_STREAM, EVENTS_DURABLE)
        if info.num_ack_pending == 1 and info.num_pending == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the detector never took the event")


async def _an_old_release_created_the_consumer(h: Harness) -> None:
    """The durable consumer as an earlier release left it on the server, with the long ack wait."""
    config = ConsumerConfig(
        durable_name=EVENTS_DURABLE,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=OLD_ACK_WAIT_S,
        max_deliver=6,
        max_ack_pending=10_000,
        filter_subject=subjects.AGENT_EVENTS,
    )
    await h.agents.js.add_consumer(subjects.AGENT_STREAM, config=config)


@pytest.mark.chaos
async def test_a_batch_held_by_a_killed_detector_is_handled_by_the_next_within_seconds(
    start_detector: StartDetector, sqlite_url: str
) -> None:
    first = await start_detector(sqlite_url)
    await first.stop()  # the next starts on the consumer an earlier release created
    await first.agents.js.delete_consumer(subjects.AGENT_STREAM, EVENTS_DURABLE)
    await _an_old_release_created_the_consumer(first)
    dying = await start_detector(sqlite_url)
    await dying.place("job-a", [(0, "node-1", 0)])

    stuck = dying.runtime.detector._lock  # the batch stops in the handler, as a detector killed mid-batch
    await stuck.acquire()
    crash = RankExited(source="node-1", node_id="node-1", job_id="job-a", rank=0, exit_code=1, log_tail=["boom"])
    await dying.emit("node-1", crash)
    await _held_by_the_detector(dying)
    await dying.runtime.bus.nc.close()  # killed: the connection is gone, nothing is acknowledged or given back
    loop = asyncio.get_running_loop()
    killed_at = loop.time()

    survivor = await start_detector(sqlite_url)
    try:
        while not (await survivor.incidents(job_id="job-a"))["count"]:
            assert loop.time() - killed_at < 10, "the held batch was not redelivered within 10 s"
            await asyncio.sleep(0.1)
        [incident] = (await survivor.incidents(job_id="job-a"))["data"]
        assert incident["culprit_rank"] == 0
        info = await survivor.agents.js.consumer_info(subjects.AGENT_STREAM, EVENTS_DURABLE)
        assert info.config.ack_wait is not None and info.config.ack_wait < OLD_ACK_WAIT_S
    finally:
        stuck.release()


async def test_a_batch_that_takes_longer_than_the_ack_wait_is_not_redelivered(detector: Harness) -> None:
    h = detector
    await h.place("job-a", [(0, "node-1", 0)])
    info = await h.agents.js.consumer_info(subjects.AGENT_STREAM, EVENTS_DURABLE)
    assert info.config.ack_wait is not None
    slow = h.runtime.detector._lock
    await slow.acquire()
    await h.emit("node-1", RankExited(source="node-1", node_id="node-1", job_id="job-a", rank=0, exit_code=1))
    await _held_by_the_detector(h)
    other = await h.agents.js.pull_subscribe_bind(consumer=EVENTS_DURABLE, stream=subjects.AGENT_STREAM)
    try:  # pulls from the same durable, as a second detector would, while the handler works the whole time
        redelivered = await other.fetch(1, timeout=info.config.ack_wait * 1.5)
    except TimeoutError:
        redelivered = []
    finally:
        await other.unsubscribe()
        slow.release()
    assert redelivered == []
    await h.settled()
    assert (await h.incidents(job_id="job-a"))["count"] == 1
