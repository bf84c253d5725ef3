"""Data access for jobs: keyword-only functions; writes that follow a recovery are fenced."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, cast

from sqlalchemy import delete, exists, update
from sqlalchemy.engine import CursorResult
from sqlmodel import Session, col, select

from reprise_common.clock import utcnow
from reprise_common.errors import NotFoundError
from reprise_common.events import RankAssignment, new_id
from reprise_orchestrator.jobs.models import ACTIVE_STATES, Job, JobCreate, JobLabel, JobState

OCCUPYING_STATES = ACTIVE_STATES | {JobState.PENDING}  # a job in these states holds its nodes
# Fenced updates go straight to the table: a job loaded in the session is not kept in step (callers read the job
# again when they need it), which spares the ORM's bookkeeping on the writes every recovery step makes.
JOBS = Job.__table__  # type: ignore[attr-defined]


def create(session: Session, *, spec: JobCreate, placement: list[RankAssignment], backend: str = "agents") -> Job:
    """Record a new job with its planned placement (pending until launched), run by the named compute backend."""
    job = Job(
        id=f"job-{new_id()[:12]}",
        backend=backend,
        name=spec.name,
        ranks_per_node=spec.ranks_per_node,
        working_dir=spec.working_dir,
        checkpoint_dir=spec.checkpoint_dir,
        spec=spec.model_dump(mode="json"),
        placement=placement,
    )
    session.add(job)
    session.add_all(JobLabel(job_id=job.id, key=key, value=value) for key, value in spec.labels.items())
    session.commit()
    session.refresh(job)
    return job


def discard(session: Session, job: Job) -> None:
    """Remove a job that was never launched (it lost its nodes to a concurrent submission), with its labels."""
    session.execute(delete(JobLabel).where(col(JobLabel.job_id) == job.id))
    session.delete(job)
    session.commit()


def get(session: Session, *, job_id: str) -> Job:
    """One job, or NotFoundError."""
    job = session.get(Job, job_id)
    if job is None:
        raise NotFoundError(f"job {job_id} not found")
    return job


def get_all(
    session: Session, *, state: JobState | None = None, labels: Iterable[tuple[str, str]] = (), limit: int = 100
) -> Sequence[Job]:
    """Jobs, newest first; with labels (key, value), only jobs that carry every one of them."""
    query = select(Job).order_by(col(Job.created_at).desc()).limit(limit)
    if state is not None:
        query = query.where(Job.state == state)
    for key, value in labels:  # each one an index lookup in job_label
        carries = exists().where(
            col(JobLabel.job_id) == col(Job.id), col(JobLabel.key) == key, col(JobLabel.value) == value
        )
        query = query.where(carries)
    return session.exec(query).all()


def get_all_by_backend(session: Session, *, backend: str, states: Iterable[JobState]) -> Sequence[Job]:
    """The jobs a compute backend runs that are in one of `states`, oldest first."""
    query = select(Job).where(Job.backend == backend, col(Job.state).in_(list(states)))
    return session.exec(query.order_by(col(Job.created_at))).all()


def states_of(session: Session, *, job_ids: Iterable[str]) -> dict[str, JobState]:
    """The state of each of these jobs that exists, by id."""
    query = select(Job.id, Job.state).where(col(Job.id).in_(list(job_ids)))
    return {job_id: JobState(state) for job_id, state in session.exec(query).all()}


def get_all_epochs(session: Session, *, state: JobState) -> list[tuple[str, int]]:
    """(id, restart epoch) of every job in a state, without loading their specs and placements."""
    query = select(Job.id, Job.restart_epoch).where(Job.state == state)
    return [(job_id, epoch) for job_id, epoch in session.exec(query).all()]


def get_launches(session: Session, *, job_ids: Iterable[str]) -> dict[str, tuple[JobState, int, int]]:
    """(state, restart epoch, highest fence) of each of these jobs that exists, without their specs."""
    query = select(Job.id, Job.state, Job.restart_epoch, Job.max_fence).where(col(Job.id).in_(list(job_ids)))
    return {job_id: (JobState(state), epoch, fence) for job_id, state, epoch, fence in session.exec(query).all()}


def claim_fence(session: Session, *, job_id: str, fence: int, commit: bool = True, **values: Any) -> bool:
    """Compare-and-set: record `fence` as the job's highest only if it is higher than any before it (with `values`
    written in the same statement); commit=False leaves the transaction open for what the claim writes next."""
    statement = update(JOBS).where(JOBS.c.id == job_id, JOBS.c.max_fence < fence).values(max_fence=fence, **values)
    result = session.connection().execute(statement)
    if commit:
        session.commit()
    return cast("CursorResult[Any]", result).rowcount == 1


def update_fenced(session: Session, *, job_id: str, fence: int, commit: bool = True, **values: Any) -> bool:
    """Update a job only while `fence` is still its highest; False means a newer owner took over.

    With commit=False the update joins the session's transaction (a recovery's last step and the job's end state
    are written together).
    """
    statement = update(JOBS).where(JOBS.c.id == job_id, JOBS.c.max_fence == fence).values(**values, updated_at=utcnow())
    result = session.connection().execute(statement)
    if commit:
        session.commit()
    return cast("CursorResult[Any]", result).rowcount == 1


def busy_nodes(session: Session, *, except_job: str | None = None) -> set[str]:
    """Nodes that active or pending jobs (other than `except_job`) run on, or that their running recoveries chose."""
    query = select(Job.id, Job.placement, Job.reserved_nodes).where(col(Job.state).in_(list(OCCUPYING_STATES)))
    busy: set[str] = set()
    for job_id, placement, reserved in session.exec(query).all():
        if job_id != except_job:
            busy.update(rank.node_id for rank in placement)
            busy.update(reserved)
    return busy


def placement_conflict(session: Session, job: Job) -> str | None:
    """Another job created before this one (by time, then id) and still pending or active that shares a node with
    it, if any: two replicas that placed jobs at the same moment both see it, and the later one gives way."""
    mine = set(job.nodes())
    query = select(Job).where(col(Job.state).in_(list(OCCUPYING_STATES)), col(Job.id) != job.id)
    for other in session.exec(query).all():
        if (other.created_at, other.id) < (job.created_at, job.id) and mine & {*other.nodes(), *other.reserved_nodes}:
            return other.id
    return None


def master_ports_at(session: Session, *, address: str) -> set[int]:
    """Rendezvous ports of active jobs whose master (rank 0's node) is at `address`: nodes may share a host. A job
    launched before its master's host was recorded counts wherever it is."""
    query = select(Job.master_port).where(
        col(Job.state).in_(list(ACTIVE_STATES)), col(Job.master_port) > 0, col(Job.master_addr).in_([address, ""])
    )
    return set(session.exec(query).all())
