"""Recovery records: one row per recovery, and one row per step it went through (start, end, typed result)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Column, String
from sqlalchemy import Enum as SAEnum
from sqlmodel import Field, SQLModel

from reprise_common.clock import utcnow
from reprise_common.db import TypedJSON, UTCDateTime
from reprise_common.events import IncidentChange
from reprise_orchestrator.recoveries.records import StepRecord
from reprise_orchestrator.recoveries.states import Outcome, RecoveryStep


class Recovery(SQLModel, table=True):
    """One recovery of one job, owned by the holder of its fencing token; `seq` numbers its newest step row."""

    id: str = Field(primary_key=True)
    job_id: str = Field(index=True, foreign_key="job.id")
    incident_id: str | None = None
    attached_incidents: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    fence: int = Field(index=True)
    owner: str
    step: RecoveryStep = Field(default=RecoveryStep.DETECTED, index=True)
    seq: int = Field(default=0, sa_column_kwargs={"server_default": "0"}, description="the newest step row's number")
    learned: IncidentChange | None = Field(
        default=None,
        sa_column=Column(TypedJSON(IncidentChange | None), nullable=True),
        description="the newest version of the incident, when it learned something the plan did not know",
    )
    attempt: int = 1
    # The database type keeps the name the enum had when it lived here (migration 0001), not the shared class's.
    outcome: Outcome | None = Field(default=None, sa_type=SAEnum(Outcome, name="outcome"))
    detail: str = ""
    started_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    finished_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class RecoveryStepRow(SQLModel, table=True):
    """One step of one recovery: a row of its own, so that a step begins and ends without rewriting the others.

    `data` is the step's typed result (recoveries/records.py) as JSON; read rows back through `StepRecord`.
    """

    __tablename__ = "recovery_step"

    recovery_id: str = Field(foreign_key="recovery.id", primary_key=True, ondelete="CASCADE")
    seq: int = Field(primary_key=True)
    step: str = Field(sa_type=String(32))
    attempt: int = 1
    started_at: datetime = Field(sa_type=UTCDateTime)
    ended_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    then: str = Field(default="next", sa_type=String(16))
    outcome: str | None = Field(default=None, sa_type=String(64))
    data: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))

    def record(self) -> StepRecord:
        """The row as the typed record it stores."""
        return StepRecord.model_validate(
            {
                "step": self.step,
                "attempt": self.attempt,
                "started_at": self.started_at,
                "ended_at": self.ended_at,
                "data": self.data,
                "then": self.then,
                "outcome": self.outcome,
            }
        )


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
