"""Transitions as the service writes them, on SQLite and PostgreSQL: a step begins and ends only as the policy
allows; an illegal move (verifying → stopping_ranks without a new attempt) is refused and writes nothing; a fenced-out
writer changes nothing; an end finishes the recovery and the job together."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session

from reprise_common.clock import utcnow
from reprise_common.db import make_engine
from reprise_common.events import Culprit, IncidentChange, RankAssignment
from reprise_orchestrator import schema
from reprise_orchestrator.jobs import service as jobs
from reprise_orchestrator.jobs.models import Job, JobCreate, JobState
from reprise_orchestrator.recoveries import service, views
from reprise_orchestrator.recoveries.models import Recovery
from reprise_orchestrator.recoveries.records import Baseline, Locked, StepRecord, Stopped, Then, Verified
from reprise_orchestrator.recoveries.rules import Decision, Proposal, Reason
from reprise_orchestrator.recoveries.service import Ending, FencedOutError
from reprise_orchestrator.recoveries.states import ATTEMPT_STEPS, Outcome, RecoveryStep

from . import incidents

S = RecoveryStep
T0 = utcnow()


@pytest.fixture
def claimed(database_url: str) -> Iterator[tuple[Engine, Job, IncidentChange]]:
    """A running job with a recovery just claimed (at `locked`) under fence 1."""
    engine = make_engine(database_url)
    schema.upgrade(engine)
    with Session(engine) as session:
        spec = JobCreate(name="j", node_count=1, command=["true"])
        job = jobs.create(session, spec=spec, placement=[RankAssignment(rank=0, node_id="n", gpu=0, local_rank=0)])
        assert jobs.claim_fence(session, job_id=job.id, fence=1, state=JobState.RECOVERING)
        incident = incidents.incident(
            incident_id="inc", job_id=job.id, culprit=Culprit(node_id="n", rank=0), first_symptom_at=T0
        )
        recovery = Recovery(id="rec", job_id=job.id, fence=1, owner="o", step=S.LOCKED)
        steps = [
            StepRecord(step=S.DETECTED, started_at=T0, ended_at=T0, data=incident),
            StepRecord(step=S.LOCKED, started_at=T0, ended_at=T0, data=Locked()),
        ]
        service.insert_claimed(session, recovery=recovery, steps=steps)
        session.commit()
        job = jobs.get(session, job_id=job.id)
    yield engine, job, incident
    engine.dispose()


def _proposal(job: Job, incident: IncidentChange, frm: RecoveryStep, to: RecoveryStep, **fields: object) -> Proposal:
    base: dict[str, object] = {
        "from_attempt": 1,
        "to_attempt": 1,
        "job": job,
        "incident": incident,
        "policy": job.job_spec().policy,
        "now": utcnow(),
        "baseline": Baseline(),
    }
    return Proposal(from_step=frm, to_step=to, **(base | fields))  # type: ignore[arg-type]


def _move(engine: Engine, proposal: Proposal, *, fence: int = 1, ending: Ending | None = None) -> Decision:
    with Session(engine) as session:
        answer, _ = service.transition(
            session, recovery_id="rec", fence=fence, at=utcnow(), propose=lambda _: proposal, ending=ending
        )
    return answer.decision


def _state(engine: Engine) -> tuple[RecoveryStep, list[tuple[RecoveryStep, int, bool]]]:
    with Session(engine) as session:
        recovery = session.get_one(Recovery, "rec")
        records = service.records(session, recovery_id="rec")
    return recovery.step, [(r.step, r.attempt, r.done) for r in records]


def test_steps_follow_the_policy_and_an_illegal_move_writes_nothing(
    claimed: tuple[Engine, Job, IncidentChange],
) -> None:
    engine, job, incident = claimed
    for frm, to in itertools.pairwise([S.LOCKED, *ATTEMPT_STEPS]):
        data = Stopped() if frm is S.STOPPING_RANKS else Verified()
        ending = None if frm is S.LOCKED else Ending(frm, 1, data, Then.NEXT)
        assert _move(engine, _proposal(job, incident, frm, to), ending=ending) is Decision.ACCEPT
    before = _state(engine)
    assert before[0] is S.VERIFYING and before[1][-1] == (S.VERIFYING, 1, False)

    # verifying → stopping_ranks without a new attempt: refused by the policy, and nothing is written
    same_attempt = _proposal(job, incident, S.VERIFYING, S.STOPPING_RANKS)
    with Session(engine) as session:
        answer, _ = service.transition(session, recovery_id="rec", fence=1, at=utcnow(), propose=lambda _: same_attempt)
    assert (answer.decision, answer.reason) == (Decision.REJECT, Reason.SAME_ATTEMPT)
    assert _state(engine) == before

    # the same with a new attempt is accepted; the verification's end is written with it, in one transaction
    ended = Ending(S.VERIFYING, 1, Verified(missing=[0]), Then.RETRY)
    long_ago = T0 - timedelta(hours=1)  # past any backoff
    retry = _proposal(job, incident, S.VERIFYING, S.STOPPING_RANKS, to_attempt=2, attempt_ended_at=long_ago)
    assert _move(engine, retry, ending=ended) is Decision.ACCEPT
    step, records = _state(engine)
    assert step is S.STOPPING_RANKS and records[-2:] == [(S.VERIFYING, 1, True), (S.STOPPING_RANKS, 2, False)]


def test_a_fenced_out_writer_changes_nothing_and_an_end_finishes_recovery_and_job(
    claimed: tuple[Engine, Job, IncidentChange],
) -> None:
    engine, job, incident = claimed
    with Session(engine) as session:
        assert jobs.claim_fence(session, job_id=job.id, fence=2)  # a newer owner (a cancel, another replica)
    before = _state(engine)
    with pytest.raises(FencedOutError):
        _move(engine, _proposal(job, incident, S.LOCKED, S.STOPPING_RANKS), fence=1)
    assert _state(engine) == before

    end = _proposal(job, incident, S.LOCKED, S.FAILED, outcome=Outcome.CANCELLED, detail="the job was cancelled")
    assert _move(engine, end, fence=2) is Decision.ACCEPT
    with Session(engine) as session:
        recovery = session.get_one(Recovery, "rec")
        assert (recovery.step, recovery.outcome) == (S.FAILED, Outcome.CANCELLED) and recovery.finished_at is not None
        assert jobs.get(session, job_id=job.id).state is JobState.FAILED


def test_a_recovery_read_while_it_moves_shows_only_the_steps_its_row_knows(
    claimed: tuple[Engine, Job, IncidentChange], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, job, incident = claimed
    read_rows = service.get_all_by_job

    def rows_then_a_move(session: Session, *, job_id: str) -> object:
        found = read_rows(session, job_id=job_id)  # the API's first read, then another session moves the recovery on
        assert _move(engine, _proposal(job, incident, S.LOCKED, S.STOPPING_RANKS)) is Decision.ACCEPT
        return found

    monkeypatch.setattr(service, "get_all_by_job", rows_then_a_move)
    with Session(engine) as session:
        [shown] = views.job_recoveries(job.id, session).data
    assert shown.step is S.LOCKED and [r.step for r in shown.steps] == [S.DETECTED, S.LOCKED]
    monkeypatch.setattr(service, "get_all_by_job", read_rows)
    with Session(engine) as session:  # the next read shows the move whole
        [after] = views.job_recoveries(job.id, session).data
    assert after.step is S.STOPPING_RANKS and [r.step for r in after.steps][-1] is S.STOPPING_RANKS
