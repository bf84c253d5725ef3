"""Node reports on core NATS: malformed ones counted and ignored, GPUs for node health, an older deployment's report
consumer and stored reports removed, and hangs checked at their own interval."""

from __future__ import annotations

import logging
import zlib
from datetime import datetime, timedelta
from typing import Any

import nats.js.errors
import pytest
from nats.js.api import ConsumerConfig
from prometheus_client import REGISTRY

from reprise_common import subjects
from reprise_common.clock import ManualClock, utcnow
from reprise_common.events import GpuHealth, GpuStatus, NodeReport, RankStatus
from reprise_common.provision import stream_config
from reprise_common.subjects import AGENT_STREAM, STREAMS
from reprise_detector.node_reports import REPORT_ID_BYTES
from reprise_detector.runtime import RETIRED_REPORTS_DURABLE

Harness = Any  # tests/conftest.py
StartDetector = Any


def _malformed_total() -> float:
    return REGISTRY.get_sample_value("reprise_detector_reports_malformed_total") or 0.0


async def test_a_malformed_report_is_counted_and_ignored_and_logged_once_a_minute_per_node(
    start_detector: StartDetector, sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    clock = ManualClock(utcnow())
    h = await start_detector(sqlite_url, clock=clock, watch_interval_s=3600)
    await h.place("job-a", [(0, "node-1", 0)])
    before = _malformed_total()
    caplog.set_level(logging.WARNING, logger="reprise.detector.watch")
    await h.report_bytes("node-1", b"{not json")
    await h.report("node-2")
    await h.settled()
    watcher = h.runtime.watcher
    assert "node-1" not in watcher.liveness.nodes  # a report that cannot be read does not show the node alive
    # Its ranks are read apart from the rest (when they are folded; for the node's first report at once): a report
    # whose ranks cannot be read is counted, and none of them reaches the progress book.
    await h.report_bytes("node-1", b'{"ranks": [{"rank": -1}]}')
    await h.report_bytes("node-3", b'{"ranks": [{"job_id": "job-x"}]}')  # no job placed there: still checked
    await h.settled()
    assert watcher.reports_malformed == 3 and _malformed_total() == before + 3
    assert watcher.reports_parsed == 3  # node-2's, and the two whose ranks are malformed (the rest of them was read)
    assert "job-a" not in watcher.book.jobs
    logged = [r for r in caplog.records if r.getMessage() == "ignoring malformed node reports"]
    assert [r.__dict__["node_id"] for r in logged] == ["node-1", "node-3"]  # node-1's second one is only counted
    clock.advance(61)
    await h.report_bytes("node-1", b"[]")
    await h.settled()
    logged = [r for r in caplog.records if r.getMessage() == "ignoring malformed node reports"]
    assert len(logged) == 3 and watcher.reports_malformed == 4


async def test_node_health_shows_the_gpus_of_the_last_report(detector: Harness) -> None:
    gpus = [GpuStatus(index=0, temperature_c=61.0), GpuStatus(index=1, health=GpuHealth.FAILED, last_xid=79)]
    await detector.report("node-7", gpus=gpus)
    await detector.settled()
    body = (await detector.client.get("/v1/node-health/node-7")).json()
    assert body["state"] == "alive"
    assert body["gpus"] == [
        {"index": 0, "health": "ok", "last_xid": None},
        {"index": 1, "health": "failed", "last_xid": 79},
    ]


async def test_node_health_follows_a_gpus_change_and_a_report_with_unreadable_gpus_is_malformed(
    detector: Harness,
) -> None:
    """A node's GPUs are decoded only when its report sends other GPUs than its last (most reports repeat them): the
    view still follows each change, and GPUs that cannot be read make the report malformed, whatever came before."""

    async def gpus_shown() -> list[str]:
        await detector.settled()
        body = (await detector.client.get("/v1/node-health/node-7")).json()
        return [gpu["health"] for gpu in body["gpus"]]

    healthy = [GpuStatus(index=0), GpuStatus(index=1)]
    failing = [GpuStatus(index=0), GpuStatus(index=1, health=GpuHealth.FAILED, last_xid=79)]
    await detector.report("node-7", gpus=healthy)
    await detector.report("node-7", gpus=healthy)
    assert await gpus_shown() == ["ok", "ok"]
    await detector.report("node-7", gpus=failing)
    assert await gpus_shown() == ["ok", "failed"]
    watcher = detector.runtime.watcher
    malformed = watcher.reports_malformed
    await detector.report_bytes("node-7", b'{"gpus": [{"index": -1}]}')
    assert await gpus_shown() == ["ok", "failed"] and watcher.reports_malformed == malformed + 1
    await detector.report("node-7", gpus=healthy)
    assert await gpus_shown() == ["ok", "ok"]


async def test_an_older_deployments_report_consumer_is_removed_and_its_stream_left_to_the_owner(
    start_detector: StartDetector, sqlite_url: str, nats_server: Any
) -> None:
    """The detector drops its own retired consumer; the stream's update (and purge) is the orchestrator's
    (cli/tests/test_service_jetstream.py), which alone may change a stream."""
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    [agent] = [spec for spec in STREAMS if spec.name == AGENT_STREAM]
    old = stream_config(agent)
    old.subjects = [subjects.AGENT_REPORTS, subjects.AGENT_EVENTS]  # as an older release provisioned it
    await js.update_stream(old)  # the fixture's bus provisioned the current one
    await js.add_consumer(
        AGENT_STREAM, ConsumerConfig(durable_name=RETIRED_REPORTS_DURABLE, filter_subject=subjects.AGENT_REPORTS)
    )
    for node in ("node-1", "node-2"):
        await js.publish(subjects.node_report(node), b"{}")

    h = await start_detector(sqlite_url)
    info = await js.stream_info(AGENT_STREAM)
    assert info.config.subjects == old.subjects and info.state.messages == 2
    with pytest.raises(nats.js.errors.NotFoundError):
        await js.consumer_info(AGENT_STREAM, RETIRED_REPORTS_DURABLE)
    await h.report("node-1")  # and reports still arrive
    await h.settled()
    assert h.runtime.watcher.reports_seen == 1
    await nc.close()


async def test_hangs_are_checked_at_a_jobs_deadline_before_their_interval_and_dated_when_the_limit_passed(
    start_detector: StartDetector, sqlite_url: str
) -> None:
    clock = ManualClock(utcnow())
    h = await start_detector(
        sqlite_url,
        clock=clock,
        hang_floor_s=5.0,
        hang_k=1.0,
        hang_check_interval_s=30,
        watch_interval_s=3600,
        node_lost_after_s=3600,
    )
    await h.place("job-h", [(0, "node-1", 0)])
    t0 = clock.now()
    await h.report("node-1", [RankStatus(job_id="job-h", rank=0, step=10, phase="training", heartbeat_age_s=0)])
    await h.settled()
    await h.runtime.watcher.tick()  # the first check: the rank has just moved; its 5 s limit is the next deadline
    clock.advance(4)
    await h.runtime.watcher.tick()  # neither the deadline nor the 30 s interval has come
    assert await h.open_incidents("job-h") == []
    clock.advance(2)
    await h.runtime.watcher.tick()  # past the deadline: checked now, not at the interval's check 24 s later
    [incident] = await h.open_incidents("job-h")
    assert "hung" in incident["root_cause"]
    assert datetime.fromisoformat(incident["first_symptom_at"]) == t0 + timedelta(seconds=5)


def test_an_agents_reports_differ_within_the_bytes_a_report_id_is_taken_from() -> None:
    """A report's id (which a node's loss is named by, the same in every replica) is the checksum of its first bytes
    only: an agent's report carries its event id and time there, so two reports of one node never share an id."""
    first, second = (
        NodeReport(source="node-1", node_id="node-1", interval_s=1.0, gpu_backend="sim", time=utcnow() + timedelta(s))
        for s in (0, 1)
    )
    head = first.model_dump_json().encode()[:REPORT_ID_BYTES]
    assert first.event_id.encode() in head and first.time.isoformat()[:19].encode() in head
    assert zlib.crc32(head) != zlib.crc32(second.model_dump_json().encode()[:REPORT_ID_BYTES])
