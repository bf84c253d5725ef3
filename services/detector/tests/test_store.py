"""The incident store against real SQLite and PostgreSQL: UTC-aware times, unique symptoms, stable replays."""

from __future__ import annotations

from contextlib import nullcontext
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session

from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.clock import ManualClock
from reprise_common.db import make_engine, session_scope
from reprise_common.events import Culprit, GpuXid, RankExited
from reprise_detector import schema
from reprise_detector.classify import load_rules
from reprise_detector.correlate import Target
from reprise_detector.incidents import service
from reprise_detector.incidents.models import Incident, IncidentState
from reprise_detector.observe import observe
from reprise_detector.persist import Work
from reprise_detector.pipeline import Detector
from reprise_detector.placements import PlacementMap


def _observation(xid: int = 79, time: datetime | None = None):  # type: ignore[no-untyped-def]
    event = GpuXid(source="node-1", node_id="node-1", gpu=0, xid=xid, time=time or datetime(2026, 1, 1, tzinfo=UTC))
    return observe(event, "reprise.agent.node-1.event.gpu.xid")


def _detector(database_url: str, clock: ManualClock) -> Detector:
    engine = make_engine(database_url)
    schema.upgrade(engine)
    bus = Bus(url="nats://127.0.0.1:1", service="unused")  # persist() never touches the bus
    return Detector(engine=engine, bus=bus, placements=PlacementMap(), rules=load_rules(), window_s=60, clock=clock)


async def test_times_come_back_utc_aware(database_url: str) -> None:
    clock = ManualClock(datetime(2026, 3, 1, 12, 1, tzinfo=UTC))  # opened after its first symptom
    detector = _detector(database_url, clock)
    tokyo = timezone(timedelta(hours=9))
    observation = _observation(time=datetime(2026, 3, 1, 21, 0, 5, tzinfo=tokyo))
    target = Target("job-a", Culprit(node_id="node-1", gpu=0, rank=0))
    detector.persist([Work(observation, load_rules().classify(observation.event), [target])])

    with Session(detector.engine) as session:
        [incident], _ = service.get_all(session)
        assert incident.first_symptom_at == datetime(2026, 3, 1, 12, 0, 5, tzinfo=UTC)
        assert incident.first_symptom_at.utcoffset() == timedelta(0)
        assert incident.opened_at == clock.now() and incident.opened_at.tzinfo is not None


async def test_a_naive_time_is_refused(sqlite_url: str) -> None:
    engine = make_engine(sqlite_url)
    schema.upgrade(engine)
    naive = datetime(2026, 1, 1)  # noqa: DTZ001 - the point of the test
    with pytest.raises(Exception, match="naive datetime"), session_scope(engine) as session:
        session.add(
            Incident(
                job_id="j",
                category="unknown",
                severity="info",
                root_cause="r",
                recommended_action="none",
                first_symptom_at=naive,
                opened_at=naive,
                updated_at=naive,
            )
        )


async def test_a_replay_announces_the_same_changes_with_the_same_ids(database_url: str) -> None:
    clock = ManualClock()
    detector = _detector(database_url, clock)
    observation = _observation()
    classification = load_rules().classify(observation.event)
    targets = [Target("job-a", Culprit(node_id="node-1", gpu=0, rank=0)), Target("job-b", Culprit(node_id="node-1"))]
    first = detector.persist([Work(observation, classification, targets)])
    clock.advance(5)
    again = detector.persist([Work(observation, classification, targets)])
    assert [c.msg_id for c in first] == [c.msg_id for c in again]
    assert [c.subject for c in first] == ["reprise.incident.job-a.opened", "reprise.incident.job-b.opened"]
    with Session(detector.engine) as session:
        assert len(service.get_symptoms_by_event(session, event_id=observation.event_id)) == 2
        assert service.get_all(session)[1] == 2


@pytest.mark.parametrize("job_id", ["job-a", None])
async def test_the_database_refuses_a_second_symptom_for_one_event(database_url: str, job_id: str | None) -> None:
    engine = make_engine(database_url)
    schema.upgrade(engine)
    observation = _observation()
    classification = load_rules().classify(observation.event)
    now = datetime(2026, 1, 1, tzinfo=UTC)
    for attempt in range(2):
        with pytest.raises(IntegrityError) if attempt else nullcontext(), session_scope(engine) as session:
            service.add_symptom(
                session, observation=observation, classification=classification, job_id=job_id, incident=None, now=now
            )


async def test_a_storm_in_one_batch_is_one_incident_that_counts_each_symptom_once(database_url: str) -> None:
    clock = ManualClock()
    detector = _detector(database_url, clock)
    rules = load_rules()

    def exit_work(rank: int, **fields: Any) -> Work:
        event = RankExited(source="node-1", node_id="node-1", job_id="job-a", rank=rank, time=clock.now(), **fields)
        observation = observe(event, subjects.node_event("node-1", event.type))
        assert observation is not None
        return Work(observation, rules.classify(event), [Target("job-a", Culprit(node_id="node-1", rank=rank))])

    peer = {"exit_code": 1, "log_tail": ["RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer"]}
    # Two peers fail before the crash that caused them, two after, all in one batch; then two more in the next.
    batch = [
        exit_work(1, **peer),
        exit_work(2, **peer),
        exit_work(0, signal="SIGKILL"),
        exit_work(3, **peer),
        exit_work(4, **peer),
    ]
    first = detector.persist(batch)
    assert [(c.event.change, c.event.symptom_count) for c in first] == [("opened", 3), ("updated", 5)]
    assert [c.msg_id for c in detector.persist(batch)] == [c.msg_id for c in first]  # redelivered: the same changes
    later = detector.persist([exit_work(5, **peer), exit_work(6, **peer)])
    assert [(c.event.change, c.event.symptom_count) for c in later] == [("updated", 7)]

    with Session(detector.engine) as session:
        [incident], count = service.get_all(session)
        assert count == 1 and incident.symptom_count == 7 and incident.culprit_rank == 0
        symptoms = service.get_symptoms(session, incident_id=incident.id)
        assert sorted((s.rank, s.decision, s.change, s.change_seq) for s in symptoms) == [
            (0, "open", "opened", 3),
            (1, "suppress", None, None),  # adopted when the crash opened the incident
            (2, "suppress", None, None),
            (3, "suppress", "updated", 4),
            (4, "suppress", "updated", 5),
            (5, "suppress", "updated", 6),
            (6, "suppress", "updated", 7),
        ]


async def test_resolve_sets_the_state_once(sqlite_url: str) -> None:
    clock = ManualClock()
    detector = _detector(sqlite_url, clock)
    observation = _observation()
    [change] = detector.persist(
        [Work(observation, load_rules().classify(observation.event), [Target("job-a", Culprit())])]
    )
    incident_id = change.event.incident_id
    for _ in range(2):
        with session_scope(detector.engine) as session:
            service.resolve(session, incident_id=incident_id, now=clock.now())
        clock.advance(10)
    with Session(detector.engine) as session:
        incident = service.get(session, incident_id=incident_id)
        assert incident.state == IncidentState.RESOLVED
        assert incident.resolved_at == datetime(2026, 1, 1, tzinfo=UTC)
        assert incident.updated_at == datetime(2026, 1, 1, tzinfo=UTC)
