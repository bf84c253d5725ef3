"""Where jobs may run: rendezvous ports per job and epoch (never one another active job's master holds on the same
host), and nodes that concurrent placements may not share."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, create_engine

from reprise_common.errors import ConflictError
from reprise_common.events import RankAssignment
from reprise_orchestrator import schema
from reprise_orchestrator.jobs import service
from reprise_orchestrator.jobs.launch import PORT_SPAN, master_port_for
from reprise_orchestrator.jobs.models import Job, JobCreate, JobState

BASE = 29500


def test_ports_differ_by_epoch_and_by_job_and_stay_in_the_span() -> None:
    ports = [master_port_for(BASE, job_id="job-a", epoch=epoch, taken=set()) for epoch in range(5)]
    assert len(set(ports)) == 5 and all(BASE <= p < BASE + PORT_SPAN for p in ports)
    assert master_port_for(BASE, job_id="job-a", epoch=3, taken=set()) == ports[3]  # a resumed launch: the same
    others = {master_port_for(BASE, job_id=f"job-{n}", epoch=0, taken=set()) for n in range(20)}
    assert len(others) > 15  # spread by job id, not all at the base


def test_a_taken_port_is_skipped_and_a_full_span_is_refused() -> None:
    first = master_port_for(BASE, job_id="job-a", epoch=0, taken=set())
    second = master_port_for(BASE, job_id="job-a", epoch=0, taken={first})
    assert second != first and BASE <= second < BASE + PORT_SPAN
    with pytest.raises(ConflictError, match="every rendezvous port"):
        master_port_for(BASE, job_id="job-a", epoch=0, taken=set(range(BASE, BASE + PORT_SPAN)))


def test_ports_in_use_are_those_of_active_jobs_whose_master_shares_the_host(tmp_path: Path) -> None:
    engine = _engine(tmp_path)
    rows = [  # master's host, state, port
        ("10.0.0.1", JobState.RUNNING, 29501),
        ("10.0.0.1", JobState.RECOVERING, 29502),
        ("10.0.0.2", JobState.RUNNING, 29503),  # another host
        ("10.0.0.1", JobState.COMPLETED, 29504),  # over
        ("", JobState.RUNNING, 29505),  # launched before hosts were recorded: counts on every host
    ]
    with Session(engine) as session:
        for host, state, port in rows:
            spec = JobCreate(name="j", nodes=["node-1"], command=["true"])
            master = RankAssignment(rank=0, node_id="node-1", gpu=0, local_rank=0)
            job = service.create(session, spec=spec, placement=[master])
            job.state, job.master_port, job.master_addr = state, port, host
            session.add(job)
            session.commit()
        taken = service.master_ports_at(session, address="10.0.0.1")
    assert taken == {29501, 29502, 29505}


def _engine(tmp_path: Path) -> Engine:
    engine = create_engine(f"sqlite:///{tmp_path / 'o.db'}")
    schema.upgrade(engine)
    return engine


def _job(session: Session, nodes: list[str], state: JobState = JobState.PENDING) -> Job:
    spec = JobCreate(name="j", nodes=nodes, command=["true"])
    placement = [RankAssignment(rank=i, node_id=node, gpu=0, local_rank=0) for i, node in enumerate(nodes)]
    job = service.create(session, spec=spec, placement=placement)
    job.state = state
    session.add(job)
    session.commit()
    return job


def test_of_two_jobs_placed_on_the_same_node_at_once_the_later_gives_way(tmp_path: Path) -> None:
    with Session(_engine(tmp_path)) as session:
        first = _job(session, ["node-1", "node-2"])  # both replicas chose node-2 before either committed
        second = _job(session, ["node-2", "node-3"])
        apart = _job(session, ["node-4"])
        assert service.placement_conflict(session, second) == first.id
        assert service.placement_conflict(session, first) is None  # the earlier one keeps its nodes
        assert service.placement_conflict(session, apart) is None
        first.state = JobState.FAILED  # a job that is over holds nothing
        session.add(first)
        session.commit()
        assert service.placement_conflict(session, second) is None


def test_nodes_a_running_recovery_placed_are_busy_before_its_launch(tmp_path: Path) -> None:
    with Session(_engine(tmp_path)) as session:
        job = _job(session, ["node-1"], JobState.RECOVERING)
        job.reserved_nodes = ["spare-1"]  # what the placing step writes
        session.add(job)
        session.commit()
        assert service.busy_nodes(session) == {"node-1", "spare-1"}
        assert service.busy_nodes(session, except_job=job.id) == set()  # its own recovery may re-place it
        other = _job(session, ["spare-1", "node-3"])
        assert service.placement_conflict(session, other) == job.id  # a new job may not take the reserved spare
        job.state = JobState.FAILED  # the recovery gave up: its job holds nothing any more
        session.add(job)
        session.commit()
        assert service.busy_nodes(session) == {"spare-1", "node-3"}
