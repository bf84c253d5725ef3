"""Recovery records: one row per recovery, every step with its start and end time and its typed result."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import JSON, Column
from sqlmodel import Field, SQLModel

from reprise_common.clock import utcnow
from reprise_common.db import TypedJSON, UTCDateTime
from reprise_common.events import IncidentChange
from reprise_orchestrator.recoveries.records import StepRecord
from reprise_orchestrator.recoveries.states import Outcome, RecoveryStep


class Recovery(SQLModel, table=True):
    """One recovery of one job, owned by the holder of its fencing token."""

    id: str = Field(primary_key=True)
    job_id: str = Field(index=True, foreign_key="job.id")
    incident_id: str | None = None
    attached_incidents: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    fence: int = Field(index=True)
    owner: str
    step: RecoveryStep = Field(default=RecoveryStep.DETECTED, index=True)
    steps: list[StepRecord] = Field(default_factory=list, sa_column=Column(TypedJSON(list[StepRecord]), nullable=False))
    learned: IncidentChange | None = Field(
        default=None,
        sa_column=Column(TypedJSON(IncidentChange | None), nullable=True),
        description="the newest version of the incident, when it learned something the plan did not know",
    )
    attempt: int = 1
    outcome: Outcome | None = None
    detail: str = ""
    started_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    finished_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class RecoveryPublic(SQLModel):
    """A recovery as the API shows it."""

    id: str
    job_id: str
    incident_id: str | None
    attached_incidents: list[str]
    fence: int
    owner: str
    step: RecoveryStep
    steps: list[StepRecord]
    learned: IncidentChange | None = None
    attempt: int
    outcome: Outcome | None
    detail: str
    started_at: datetime
    finished_at: datetime | None


class RecoveriesPublic(SQLModel):
    """A job's recoveries."""

    data: list[RecoveryPublic]
    count: int
