"""Each service's JetStream work with the NATS identity the stack gives it, against a real nats-server: it provisions
the streams, reads through its own durable consumers (the services' own names) and acknowledges, publishes what it
owns; another service's consumer, a stream deletion and another service's events are refused."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy

from reprise_common import subjects
from reprise_common.aio import poll_until
from reprise_common.bus import Bus, Delivery, Outcome
from reprise_common.clock import utcnow
from reprise_common.errors import BusError
from reprise_common.events import (
    Category,
    CheckpointChange,
    CheckpointSaved,
    ComputeSignal,
    ComputeSignalKind,
    Culprit,
    DeadLetter,
    Event,
    GpuXid,
    IncidentChange,
    JobPlacement,
    NodeQuarantineRecommended,
    NodeReport,
    QuarantineReason,
    RankAssignment,
    RecommendedAction,
    RecoveryChange,
    Severity,
)
from reprise_common.provision import stream_config
from reprise_detector import runtime as detector
from reprise_detector.partition import Partition
from reprise_notifier import runtime as notifier
from reprise_orchestrator import app as orchestrator
from reprise_registry import app as registry

from .conftest import NODES, SERVICES, Deployment


def _incident(change: str) -> IncidentChange:
    return IncidentChange(
        source="detector",
        change=change,
        incident_id="inc-1",
        job_id="job-1",
        category=Category.GPU_HARDWARE,
        severity=Severity.CRITICAL,
        root_cause="XID 79 on node-1 GPU 0",
        culprit=Culprit(node_id="node-1", gpu=0, rank=0),
        recommended_action=RecommendedAction.RESTART_EXCLUDE_NODE,
        first_symptom_at=utcnow(),
    )


def _placement() -> JobPlacement:
    ranks = [RankAssignment(rank=0, node_id="node-1", gpu=0, local_rank=0)]
    return JobPlacement(source="orchestrator", job_id="job-1", restart_epoch=1, world_size=1, ranks=ranks)


def _subjects_of(stream: str) -> tuple[str, ...]:
    return next(spec.subjects for spec in subjects.STREAMS if spec.name == stream)


async def _connected(deployment: Deployment, name: str) -> Bus:
    bus = deployment.bus(name)
    await bus.connect(attempts=5)
    return bus


async def _consume(
    bus: Bus, stream: str, durable: str, filter_subject: str, policy: DeliverPolicy = DeliverPolicy.ALL
) -> list[Event]:
    """Read a stream through a durable consumer as the services do; the events, acknowledged once handled."""
    got: list[Event] = []

    async def handle(event: Event, _delivery: Delivery) -> Outcome:
        got.append(event)
        return Outcome.ACK

    await bus.consumer(
        stream=stream, durable=durable, filter_subject=filter_subject, handler=handle, deliver_policy=policy
    ).open()
    return got


async def _acknowledged(js: JetStreamContext, stream: str, durable: str, count: int) -> None:
    """Wait until the consumer's first `count` deliveries are acknowledged (the ack subjects are allowed)."""
    info = await js.consumer_info(stream, durable)
    for _ in range(250):
        if info.num_ack_pending == 0 and (info.ack_floor.consumer_seq or 0) >= count:
            return
        await asyncio.sleep(0.02)
        info = await js.consumer_info(stream, durable)
    raise AssertionError(f"{durable} on {stream}: acknowledgements did not arrive: {info}")


@pytest.mark.parametrize("service", SERVICES)
async def test_each_service_provisions_every_stream_and_only_the_owner_updates_an_older_release(
    deployment: Deployment, admin: Client, service: str
) -> None:
    js = admin.jetstream()
    agent_spec = next(spec for spec in subjects.STREAMS if spec.name == subjects.AGENT_STREAM)
    older = dataclasses.replace(stream_config(agent_spec), subjects=[subjects.AGENT_EVENTS, subjects.AGENT_REPORTS])
    await js.add_stream(older)  # an older release stored node reports in AGENT
    await js.publish(subjects.node_report("node-1"), b"{}")
    for _start in range(2):  # the first start updates the older stream and purges it; a restart finds them all
        bus = await _connected(deployment, service)
        await bus.close()
    for spec in subjects.STREAMS:
        if spec.name != subjects.AGENT_STREAM:  # created by whichever service came first
            assert (await js.stream_info(spec.name)).config.subjects == list(spec.subjects), spec.name
    agent = await js.stream_info(subjects.AGENT_STREAM)
    if service == subjects.STREAMS_OWNER:
        assert (agent.config.subjects, agent.state.messages) == (list(agent_spec.subjects), 0)
    else:  # left as it was, for the owner to update
        assert (agent.config.subjects, agent.state.messages) == (older.subjects, 1)


async def test_detector_reads_agent_events_reports_placements_and_recovery_outcomes(
    deployment: Deployment, admin: Client
) -> None:
    planner = await _connected(deployment, "orchestrator")
    await planner.publish(subjects.placement("job-1"), _placement())
    bus = await _connected(deployment, "detector")
    replica = Partition(index=1, count=2)  # a replica of two names its durable consumers after its partition
    # What the detector's runtime does at each start: drop its placements consumer (to replay them), read the
    # stream's state, drop the retired reports consumer, then consume.
    with contextlib.suppress(nats.js.errors.NotFoundError):
        await bus.js.delete_consumer(subjects.PLACEMENTS_STREAM, replica.durable(detector.PLACEMENTS_DURABLE))
    assert (await bus.js.stream_info(subjects.PLACEMENTS_STREAM)).state.messages == 1
    placements = await _consume(
        bus,
        subjects.PLACEMENTS_STREAM,
        replica.durable(detector.PLACEMENTS_DURABLE),
        subjects.PLACEMENTS_ALL,
        DeliverPolicy.LAST_PER_SUBJECT,
    )
    with contextlib.suppress(nats.js.errors.NotFoundError):
        await bus.js.delete_consumer(subjects.AGENT_STREAM, replica.durable(detector.RETIRED_REPORTS_DURABLE))
    events_durable = replica.durable(detector.EVENTS_DURABLE)
    events = await _consume(bus, subjects.AGENT_STREAM, events_durable, subjects.AGENT_EVENTS)
    reports: list[str] = []

    async def on_reports(batch: dict[str, bytes]) -> None:
        reports.extend(batch)

    await bus.follow(subjects.AGENT_REPORTS, handler=on_reports).open()
    agent = await _connected(deployment, "node-1")
    await agent.publish(
        subjects.node_event("node-1", "gpu.xid"), GpuXid(source="node-1", node_id="node-1", gpu=0, xid=79)
    )
    report = NodeReport(source="node-1", node_id="node-1", interval_s=0.05, gpu_backend="sim")
    for _ in range(100):  # an agent reports every interval; the first may precede the subscription
        await agent.publish_snapshot(subjects.node_report("node-1"), report)
        if await poll_until(lambda: reports, timeout_s=0.05):
            break
    assert await poll_until(lambda: placements and events, timeout_s=5), (placements, events)
    assert reports and reports[0] == subjects.node_report("node-1")
    assert isinstance(placements[0], JobPlacement) and isinstance(events[0], GpuXid)
    js = admin.jetstream()
    await _acknowledged(js, subjects.PLACEMENTS_STREAM, replica.durable(detector.PLACEMENTS_DURABLE), 1)
    await _acknowledged(js, subjects.AGENT_STREAM, events_durable, 1)
    # Recovery outcomes mitigate incidents: the detector reads them through a durable of its own too.
    outcomes_durable = replica.durable(detector.RECOVERIES_DURABLE)
    outcomes = await _consume(bus, subjects.RECOVERIES_STREAM, outcomes_durable, subjects.RECOVERIES_ALL)
    succeeded = RecoveryChange(
        source="orchestrator", change="succeeded", recovery_id="rec-1", job_id="job-1", step="running", fence=2
    )
    await planner.publish(subjects.recovery("job-1", "succeeded"), succeeded)
    assert await poll_until(lambda: outcomes, timeout_s=5), outcomes
    await _acknowledged(js, subjects.RECOVERIES_STREAM, outcomes_durable, 1)
    # The compute backend's failure signals are symptoms: the detector reads them through a durable of its own.
    signals_durable = replica.durable(detector.COMPUTE_DURABLE)
    signals = await _consume(bus, subjects.COMPUTE_STREAM, signals_durable, subjects.COMPUTE_SIGNALS_ALL)
    down = ComputeSignal(source="orchestrator", backend="slurm", kind=ComputeSignalKind.NODE_DOWN, node_id="node-1")
    await planner.publish(subjects.compute_signal("slurm"), down)
    assert await poll_until(lambda: signals, timeout_s=5), signals
    await _acknowledged(js, subjects.COMPUTE_STREAM, signals_durable, 1)
    for each in (agent, bus, planner):
        await each.close()


async def test_incidents_and_quarantines_reach_the_orchestrator_and_the_notifier(
    deployment: Deployment, admin: Client
) -> None:
    source = await _connected(deployment, "detector")
    planner = await _connected(deployment, "orchestrator")
    opened = await _consume(
        planner, subjects.INCIDENTS_STREAM, orchestrator.INCIDENTS_DURABLE, subjects.INCIDENTS_OPENED
    )
    updated = await _consume(
        planner, subjects.INCIDENTS_STREAM, orchestrator.INCIDENT_UPDATES_DURABLE, subjects.INCIDENTS_UPDATED
    )
    quarantines = await _consume(
        planner, subjects.NODES_STREAM, orchestrator.QUARANTINE_DURABLE, subjects.NODE_QUARANTINE_ALL
    )
    alerting = await _connected(deployment, "notifier")
    alerts = await _consume(
        alerting, subjects.INCIDENTS_STREAM, notifier.INCIDENTS_DURABLE, subjects.INCIDENTS_ALL, DeliverPolicy.NEW
    )
    await source.publish(subjects.incident("job-1", "opened"), _incident("opened"))
    await source.publish(subjects.incident("job-1", "updated"), _incident("updated"))
    lemon = NodeQuarantineRecommended(source="detector", node_id="node-1", reason=QuarantineReason.REPEATED_XID)
    await source.publish(subjects.node_quarantine("node-1"), lemon)
    assert await poll_until(lambda: opened and updated and quarantines and len(alerts) == 2, timeout_s=5), (
        opened,
        updated,
        quarantines,
        alerts,
    )
    js = admin.jetstream()
    await _acknowledged(js, subjects.INCIDENTS_STREAM, orchestrator.INCIDENTS_DURABLE, 1)
    await _acknowledged(js, subjects.INCIDENTS_STREAM, orchestrator.INCIDENT_UPDATES_DURABLE, 1)
    await _acknowledged(js, subjects.NODES_STREAM, orchestrator.QUARANTINE_DURABLE, 1)
    await _acknowledged(js, subjects.INCIDENTS_STREAM, notifier.INCIDENTS_DURABLE, 2)
    for each in (alerting, planner, source):
        await each.close()


async def test_placements_recoveries_and_signals_reach_the_registry_and_the_notifier(
    deployment: Deployment, admin: Client
) -> None:
    planner = await _connected(deployment, "orchestrator")
    archive = await _connected(deployment, "checkpoint-registry")
    placements = await _consume(
        archive, subjects.PLACEMENTS_STREAM, registry.PLACEMENTS_DURABLE, subjects.PLACEMENTS_ALL
    )
    alerting = await _connected(deployment, "notifier")
    recoveries = await _consume(
        alerting, subjects.RECOVERIES_STREAM, notifier.RECOVERIES_DURABLE, subjects.RECOVERIES_ALL, DeliverPolicy.NEW
    )
    await planner.publish(subjects.placement("job-1"), _placement())
    started = RecoveryChange(
        source="orchestrator", change="started", recovery_id="rec-1", job_id="job-1", step="detected", fence=2
    )
    await planner.publish(subjects.recovery("job-1", "started"), started)
    signal = ComputeSignal(source="orchestrator", backend="agents", kind=ComputeSignalKind.NODE_DOWN, node_id="node-1")
    await planner.publish(subjects.compute_signal("agents"), signal)
    assert await poll_until(lambda: placements and recoveries, timeout_s=5), (placements, recoveries)
    js = admin.jetstream()
    await _acknowledged(js, subjects.PLACEMENTS_STREAM, registry.PLACEMENTS_DURABLE, 1)
    await _acknowledged(js, subjects.RECOVERIES_STREAM, notifier.RECOVERIES_DURABLE, 1)
    assert (await js.stream_info(subjects.COMPUTE_STREAM)).state.messages == 1
    for each in (alerting, archive, planner):
        await each.close()


async def test_registry_reads_saved_checkpoints_and_announces_changes(deployment: Deployment, admin: Client) -> None:
    archive = await _connected(deployment, "checkpoint-registry")
    saved = await _consume(
        archive, subjects.AGENT_STREAM, registry.CHECKPOINTS_DURABLE, subjects.AGENT_CHECKPOINTS_SAVED
    )
    agent = await _connected(deployment, "node-2")
    event = CheckpointSaved(source="node-2", node_id="node-2", job_id="job-1", rank=1, step=100, path="/ckpt/100")
    await agent.publish(subjects.node_event("node-2", event.type), event)
    assert await poll_until(lambda: saved, timeout_s=5)
    await _acknowledged(admin.jetstream(), subjects.AGENT_STREAM, registry.CHECKPOINTS_DURABLE, 1)
    change = CheckpointChange(
        source="checkpoint-registry", change="validated", checkpoint_id=1, job_id="job-1", step=100, path="/ckpt/100"
    )
    assert await archive.publish(subjects.checkpoint("job-1", "validated"), change) == 1
    for each in (agent, archive):
        await each.close()


@pytest.mark.parametrize("service", ["checkpoint-registry", "detector", "orchestrator", "notifier"])
async def test_each_consuming_service_dead_letters_what_it_cannot_use(
    deployment: Deployment, admin: Client, service: str
) -> None:
    bus = await _connected(deployment, service)
    await bus.dead_letter(
        consumer="any", subject="reprise.agent.node-1.event.x", data=b"{", reason="malformed: x", key="k", delivered=1
    )
    stored = await admin.jetstream().get_last_msg(subjects.DEAD_LETTER_STREAM, subjects.dead_letter(service))
    letter = DeadLetter.model_validate_json(stored.data or b"")
    assert letter.source == service and letter.original_subject == "reprise.agent.node-1.event.x"
    await bus.close()


@pytest.mark.parametrize("forger", [name for name in (*SERVICES, *NODES) if name != "detector"])
async def test_only_the_detector_stores_incidents(deployment: Deployment, admin: Client, forger: str) -> None:
    source = await _connected(deployment, "detector")
    bus = await _connected(deployment, forger)
    fake = _incident("opened").model_copy(update={"source": forger})
    with pytest.raises(BusError, match=r"publish to reprise\.incident\.job-1\.opened failed"):
        await bus.publish(subjects.incident("job-1", "opened"), fake, timeout=1.0)
    assert (await admin.jetstream().stream_info(subjects.INCIDENTS_STREAM)).state.messages == 0
    await source.publish(subjects.incident("job-1", "opened"), _incident("opened"))
    assert (await admin.jetstream().stream_info(subjects.INCIDENTS_STREAM)).state.messages == 1
    for each in (bus, source):
        await each.close()


# An identity and a durable consumer that is not its own: reading it would take (and acknowledge away) what belongs
# to another service; an agent reads no stream at all.
FOREIGN_CONSUMERS = [
    ("notifier", subjects.INCIDENTS_STREAM, orchestrator.INCIDENTS_DURABLE),
    ("orchestrator", subjects.INCIDENTS_STREAM, notifier.INCIDENTS_DURABLE),
    ("checkpoint-registry", subjects.INCIDENTS_STREAM, orchestrator.INCIDENTS_DURABLE),
    ("dashboard", subjects.INCIDENTS_STREAM, notifier.INCIDENTS_DURABLE),
    ("detector", subjects.INCIDENTS_STREAM, orchestrator.INCIDENTS_DURABLE),
    ("node-1", subjects.AGENT_STREAM, detector.EVENTS_DURABLE),
]


@pytest.mark.parametrize(("identity", "stream", "durable"), FOREIGN_CONSUMERS)
async def test_no_identity_reads_another_services_consumer_or_deletes_a_stream(
    deployment: Deployment, identity: str, stream: str, durable: str
) -> None:
    owner = await _connected(deployment, "orchestrator")  # provisions the streams
    errors: list[Exception] = []
    client = await deployment.client(identity, errors)
    js = client.jetstream(timeout=1.0)
    with pytest.raises(nats.errors.TimeoutError):  # the server drops the request: no answer comes
        await js.add_consumer(stream, durable_name=durable, filter_subject=_subjects_of(stream)[0])
    with pytest.raises(nats.errors.TimeoutError):
        await js.delete_stream(stream)
    forbidden = [f"consumer.durable.create.{stream}.{durable}", f"stream.delete.{stream}"]
    if identity != subjects.STREAMS_OWNER:  # e.g. a longer max age, or no limits at all
        spec = next(s for s in subjects.STREAMS if s.name == stream)
        with pytest.raises(nats.errors.TimeoutError):
            await js.update_stream(dataclasses.replace(stream_config(spec), max_age=None))
        forbidden.append(f"stream.update.{stream}")
    refused = " ".join(str(exc) for exc in errors).lower()  # the server's message, as nats-py hands it over
    for subject in forbidden:
        assert f'"$js.api.{subject.lower()}"' in refused, errors
    await client.close()
    await owner.close()
