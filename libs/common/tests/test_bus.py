"""The bus against a real nats-server: streams, dedup, consumers, dead letters, reconnects, followed snapshots."""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import nats
import pytest
from nats.aio.msg import Msg
from nats.js.api import StreamConfig
from prometheus_client import REGISTRY

from reprise_cli.servers import NatsCluster, NatsServer
from reprise_common import subjects
from reprise_common.aio import poll_until
from reprise_common.bus import Bus, Delivery, Outcome
from reprise_common.errors import BusError, MalformedEventError
from reprise_common.events import DeadLetter, Event, GpuXid, NodeReport, parse_event
from reprise_common.follow import Follower


async def _wait_for(predicate: Callable[[], object], timeout: float = 10.0) -> bool:
    return await poll_until(predicate, timeout_s=timeout)


async def test_streams_are_provisioned_idempotently(nats_server: NatsServer) -> None:
    bus = Bus(url=nats_server.url, service="test")
    await bus.connect(attempts=5)
    await bus.ensure_streams()  # a second time changes nothing and raises nothing
    names = {info.config.name for info in await bus.js.streams_info()}
    assert {"AGENT", "INCIDENTS", "PLACEMENTS", "RECOVERIES", "DEADLETTER"} <= names
    await bus.close()


async def test_a_service_started_with_a_new_cluster_waits_for_it_to_form_then_provisions(tmp_path: Path) -> None:
    """Right after a 3-server cluster starts, JetStream has no meta leader or too few peers for a replicated stream
    (a timeout, or "no suitable peers"); a service started with it must provision once the cluster forms, not give
    up and stay unready."""
    cluster = NatsCluster.start_on_free_ports(tmp_path)
    bus = Bus(url=cluster.url, service="test", replicas=3)
    try:
        await asyncio.wait_for(bus.connect(), timeout=60)
        info = await bus.js.stream_info("AGENT")
        assert info.config.num_replicas == 3
    finally:
        await bus.close()
        cluster.stop()


async def test_streams_a_whole_cluster_lost_are_provisioned_again_once_it_has_formed_after_the_reconnect(
    tmp_path: Path,
) -> None:
    """Every member restarted without its store (a cluster rebuilt, a volume lost): the client reconnects to the
    first member back, before the cluster has a quorum, so its provisioning after the reconnect fails; the streams
    must still come back once the others join, or no consumer could ever subscribe again."""
    cluster = NatsCluster.start_on_free_ports(tmp_path)
    bus = Bus(url=cluster.url, service="test", replicas=3)
    try:
        await asyncio.wait_for(bus.connect(), timeout=60)
        generation = bus.generation
        await asyncio.to_thread(cluster.stop)
        for server in cluster.servers:
            shutil.rmtree(server.store_dir)
        first, *others = cluster.servers
        await asyncio.to_thread(first.start)  # alone: no meta leader, every JetStream request times out
        assert await poll_until(lambda: bus.generation > generation, timeout_s=60)  # reconnected, provisioning failed
        for server in others:
            await asyncio.to_thread(server.start)

        async def agent_stream_exists() -> bool:
            try:
                await asyncio.wait_for(bus.js.stream_info("AGENT"), timeout=3)
            except (nats.errors.Error, TimeoutError):
                return False
            return True

        deadline = asyncio.get_running_loop().time() + 60
        while not await agent_stream_exists():
            assert asyncio.get_running_loop().time() < deadline, "the streams never came back"
            await asyncio.sleep(0.5)
    finally:
        await bus.close()
        cluster.stop()


async def test_provisioning_refused_for_a_reason_other_than_a_forming_cluster_raises_at_once(
    nats_server: NatsServer,
) -> None:
    """A single server can never place 3 replicas, but it answers with another refusal than a forming cluster's:
    connect raises instead of waiting forever."""
    bus = Bus(url=nats_server.url, service="test", replicas=3)
    with pytest.raises(BusError, match="cannot provision stream"):
        await asyncio.wait_for(bus.connect(), timeout=30)
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


async def test_a_publish_no_stream_answers_is_tried_again_until_one_does(nats_server: NatsServer) -> None:
    """A stream without a leader for a moment (an election, a restart) answers nobody: the publish waits for it within
    its timeout, where it failed at once (a submission, whose placement could not be published, was answered 503)."""
    bus = Bus(url=nats_server.url, service="test", provision=False)
    await bus.connect(attempts=5)
    try:
        event = GpuXid(source="node-1", node_id="node-1", gpu=0, xid=79)
        subject = "test.later.one"
        with pytest.raises(BusError, match="NoStreamResponseError"):
            await bus.publish(subject, event, timeout=0.3)

        async def stream_soon() -> None:
            await asyncio.sleep(0.4)
            await bus.js.add_stream(StreamConfig(name="LATER", subjects=["test.later.>"]))

        made = asyncio.create_task(stream_soon())
        sequence = await bus.publish(subject, event, timeout=5.0)
        await made
        assert sequence == 1 and (await bus.js.stream_info("LATER")).state.messages == 1
    finally:
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

    bus.consumer(stream="AGENT", durable="c", filter_subject=subjects.AGENT_EVENTS, handler=handle).start()
    await bus.publish(subjects.node_event("node-1", "gpu.xid"), GpuXid(source="n", node_id="node-1", gpu=0, xid=79))
    assert await _wait_for(lambda: len(seen) == 1)

    await asyncio.to_thread(nats_server.stop)
    assert await _wait_for(lambda: not bus.connected)
    await asyncio.to_thread(nats_server.start)
    assert await _wait_for(lambda: bus.connected, timeout=15)

    later = GpuXid(source="n", node_id="node-1", gpu=1, xid=79)
    await bus.publish(subjects.node_event("node-1", "gpu.xid"), later)
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


def _report(node: str) -> NodeReport:
    return NodeReport(source=node, node_id=node, interval_s=1.0, gpu_backend="sim")


async def test_reports_are_not_stored_and_an_older_agent_stream_drops_them(nats_server: NatsServer) -> None:
    nc = await nats.connect(nats_server.url)  # an older release stored reports and events in AGENT
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="AGENT", subjects=[subjects.AGENT_REPORTS, subjects.AGENT_EVENTS]))
    await js.publish(subjects.node_report("node-1"), _report("node-1").to_bytes())
    await js.publish(
        subjects.node_event("node-1", "gpu.xid"), GpuXid(source="n", node_id="node-1", gpu=0, xid=79).to_bytes()
    )
    await nc.close()

    bus = Bus(url=nats_server.url, service="test")
    await bus.connect(attempts=5)  # provisions: the stream is updated, its stored reports purged
    info = await bus.js.stream_info("AGENT")
    assert info.config.subjects == [subjects.AGENT_EVENTS]
    assert info.state.messages == 1  # the event stays
    await bus.publish_snapshot(subjects.node_report("node-1"), _report("node-1"))
    await bus.nc.flush()
    assert (await bus.js.stream_info("AGENT")).state.messages == 1
    await bus.close()


async def test_a_follower_gets_the_latest_report_per_node_and_resumes_after_a_restart(
    nats_server: NatsServer,
) -> None:
    bus = Bus(url=nats_server.url, service="test")
    await bus.connect(attempts=5)
    batches: list[dict[str, NodeReport]] = []
    release = asyncio.Event()

    async def handle(reports: dict[str, bytes]) -> None:
        batches.append({s: NodeReport.model_validate_json(d) for s, d in reports.items()})
        await release.wait()  # the first batch holds the handler while more reports arrive

    metric = {"service": "test", "subject_kind": "reprise.agent.report", "outcome": "superseded"}
    superseded = REGISTRY.get_sample_value("reprise_snapshots_total", metric) or 0.0
    follower = bus.follow(subjects.AGENT_REPORTS, handler=handle)
    await follower.open()
    await bus.publish_snapshot(subjects.node_report("node-0"), _report("node-0"))
    assert await _wait_for(lambda: len(batches) == 1)
    older, newer, other = _report("node-1"), _report("node-1"), _report("node-2")
    for report in (older, newer, other):
        await bus.publish_snapshot(subjects.node_report(report.node_id), report)
    assert await _wait_for(lambda: follower.received == 4)
    release.set()
    assert await _wait_for(lambda: follower.idle and len(batches) == 2)
    assert {s: r.event_id for s, r in batches[1].items()} == {
        subjects.node_report("node-1"): newer.event_id,  # the older report of node-1 was superseded, not handled
        subjects.node_report("node-2"): other.event_id,
    }
    assert (follower.handled, follower.superseded) == (3, 1)
    assert REGISTRY.get_sample_value("reprise_snapshots_total", metric) == superseded + 1

    await asyncio.to_thread(nats_server.stop)
    assert await _wait_for(lambda: not bus.connected)
    await asyncio.to_thread(nats_server.start)
    assert await _wait_for(lambda: bus.connected, timeout=15)
    later = _report("node-1")
    await bus.publish_snapshot(subjects.node_report("node-1"), later)
    assert await _wait_for(lambda: any(r.event_id == later.event_id for b in batches for r in b.values()), timeout=15)
    await bus.close()


async def test_a_snapshot_is_skipped_not_queued_while_disconnected(nats_server: NatsServer) -> None:
    bus = Bus(url=nats_server.url, service="test")
    await bus.connect(attempts=5)
    await asyncio.to_thread(nats_server.stop)
    assert await _wait_for(lambda: not bus.connected)
    with pytest.raises(BusError, match="not connected"):  # nats-py would otherwise send it late, after reconnecting
        await bus.publish_snapshot(subjects.node_report("node-1"), _report("node-1"))
    await asyncio.to_thread(nats_server.start)
    await bus.close()


async def test_a_follower_that_falls_behind_drops_and_counts_and_keeps_following(nats_server: NatsServer) -> None:
    bus = Bus(url=nats_server.url, service="test-slow")
    await bus.connect(attempts=5)
    seen: list[str] = []

    async def handle(reports: dict[str, bytes]) -> None:
        seen.extend(reports)

    follower = bus.follow(subjects.AGENT_REPORTS, handler=handle, pending_msgs=5)
    await follower.open()
    labels = {"service": "test-slow", "subject_kind": "reprise.agent.report"}
    before = REGISTRY.get_sample_value("reprise_bus_slow_consumer_dropped_total", labels) or 0.0
    sent = threading.Event()

    def burst() -> None:  # another client publishes while this process's event loop is busy
        async def run() -> None:
            nc = await nats.connect(nats_server.url)
            for n in range(50):
                await nc.publish(subjects.node_report(f"node-{n}"), b"{}")
            await nc.flush()
            await nc.close()

        asyncio.run(run())
        sent.set()

    threading.Thread(target=burst).start()
    assert sent.wait(timeout=10)  # blocks the loop: the 50 reports wait in the socket, then arrive at once
    await asyncio.sleep(0)
    assert await _wait_for(lambda: follower.received + follower.dropped == 50 and follower.idle)
    assert follower.dropped > 0
    assert REGISTRY.get_sample_value("reprise_bus_slow_consumer_dropped_total", labels) == before + follower.dropped
    await bus.publish_snapshot(subjects.node_report("node-late"), _report("node-late"))
    assert await _wait_for(lambda: subjects.node_report("node-late") in seen)
    await bus.close()


async def test_a_follower_hands_over_at_most_a_batch_at_a_time_longest_waiting_first(nats_server: NatsServer) -> None:
    batches: list[list[str]] = []
    bus, follower, release = await _held_follower(nats_server, lambda _f, reports: batches.append(list(reports)))
    release.set()
    assert await _wait_for(lambda: follower.idle and follower.handled == 6)
    assert [[s.split(".")[2] for s in b] for b in batches] == [
        ["node-0"],
        ["node-1", "node-2"],
        ["node-3", "node-4"],
        ["node-5"],
    ]
    await bus.close()


async def test_a_follower_says_how_long_what_waits_has_waited_since_all_before_was_handed_over(
    nats_server: NatsServer,
) -> None:
    """lag_s(): the subjects still waiting have sent nothing unhandled for longer than this (0 while none waits)."""
    lags: list[float] = []  # at the start of each batch
    bus, follower, release = await _held_follower(nats_server, lambda f, _reports: lags.append(f.lag_s()))
    await asyncio.sleep(0.3)
    assert follower.lag_s() >= 0.3  # everything received before node-0's batch was taken is handed over, no more
    release.set()
    assert await _wait_for(lambda: follower.idle and follower.handled == 6)
    # node-0 alone; then node-1 and 2, node-3 and 4, taken while others that arrived as early still wait; node-5 last,
    # and with it every report that had arrived.
    assert lags[0] == 0.0 and min(lags[1:3]) >= 0.3 and lags[3] == 0.0, lags
    assert follower.lag_s() == 0.0
    await bus.close()


async def test_a_follower_idle_for_a_while_is_not_behind_when_a_report_arrives(nats_server: NatsServer) -> None:
    """After a quiet spell, a report waiting to join its batch (the linger) makes the follower as far behind as that
    report has waited, not as long as the spell lasted."""
    bus = Bus(url=nats_server.url, service="test")
    await bus.connect(attempts=5)
    handled: list[str] = []

    async def handle(reports: dict[str, bytes]) -> None:
        handled.extend(reports)

    follower = bus.follow(subjects.AGENT_REPORTS, handler=handle, batch=2, linger_s=30.0)  # a batch waits until full
    await follower.open()
    names = [f"node-{n}" for n in range(4)]
    for name in names[:2]:
        await bus.publish_snapshot(subjects.node_report(name), _report(name))
    assert await _wait_for(lambda: follower.idle and follower.handled == 2)
    await asyncio.sleep(2.0)  # nothing arrives
    await bus.publish_snapshot(subjects.node_report(names[2]), _report(names[2]))
    assert await _wait_for(lambda: follower.received == 3)
    assert 0.0 < follower.lag_s() < 1.5  # node-2 has waited since it arrived (2 s and more before the fix)
    await bus.publish_snapshot(subjects.node_report(names[3]), _report(names[3]))  # fills the batch
    assert await _wait_for(lambda: follower.idle and follower.handled == 4)
    assert handled == [subjects.node_report(name) for name in names] and follower.lag_s() == 0.0
    await bus.close()


async def _feed(follower: Follower, per_turn: int, turns: int | None) -> None:
    """Deliver messages to the follower's callback as the connection would: `per_turn` new subjects at each turn of the
    event loop, for `turns` turns (None: until cancelled)."""
    sent = 0
    while turns is None or sent < per_turn * turns:
        for _ in range(per_turn):
            await follower._on_msg(Msg(_client=None, subject=subjects.node_report(f"node-{sent}"), data=b"{}"))  # type: ignore[arg-type]
            sent += 1
        await asyncio.sleep(0)


async def test_a_follower_under_a_steady_stream_hands_a_batch_over_after_a_round_of_reads() -> None:
    """The catch-up before a batch waited for a round of reads that brings nothing; under a steady stream some report
    arrives in every round, so it read for a thousand rounds (half a second at 50,000 reports/s) while the batch
    waited."""
    follower = Follower(bus=Bus(url="nats://unused", service="test"), subject=subjects.AGENT_REPORTS, handler=_ignore)
    stream = asyncio.create_task(_feed(follower, per_turn=2, turns=None))
    await asyncio.sleep(0)
    await follower._catch_up()
    stream.cancel()
    assert follower.received < 40  # a round or two of three turns, two reports a turn (6,000 and more before the fix)


async def test_a_follower_reads_a_whole_backlog_before_handing_a_batch_over() -> None:
    """A backlog (a full read at every turn) is read to its end first: the handler gets each subject's latest."""
    follower = Follower(bus=Bus(url="nats://unused", service="test"), subject=subjects.AGENT_REPORTS, handler=_ignore)
    backlog = asyncio.create_task(_feed(follower, per_turn=100, turns=50))
    await asyncio.sleep(0)
    await follower._catch_up()
    assert follower.received == 5000
    await backlog


async def _ignore(_reports: dict[str, bytes]) -> None:
    return None


async def _held_follower(
    nats_server: NatsServer, on_batch: Callable[[Follower, dict[str, bytes]], object]
) -> tuple[Bus, Follower, asyncio.Event]:
    """A follower of node reports in batches of 2 whose handler calls `on_batch` and then waits for the event: node-0's
    report is handled (and held), node-1 to node-5's wait behind it."""
    bus = Bus(url=nats_server.url, service="test")
    await bus.connect(attempts=5)
    release = asyncio.Event()
    batches = 0

    async def handle(reports: dict[str, bytes]) -> None:
        nonlocal batches
        batches += 1
        on_batch(follower, reports)
        await release.wait()

    follower = bus.follow(subjects.AGENT_REPORTS, handler=handle, batch=2)
    await follower.open()
    await bus.publish_snapshot(subjects.node_report("node-0"), _report("node-0"))
    assert await _wait_for(lambda: batches == 1)
    for n in range(1, 6):
        await bus.publish_snapshot(subjects.node_report(f"node-{n}"), _report(f"node-{n}"))
    assert await _wait_for(lambda: follower.received == 6)
    return bus, follower, release
