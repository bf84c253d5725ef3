"""Incident and symptom tables and their public shapes (SQLModel families)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from sqlalchemy import BigInteger, Column, Index, String, Text, UniqueConstraint, text
from sqlmodel import Field, SQLModel

from reprise_common.db import TypedJSON, UTCDateTime
from reprise_common.events import Category, IncidentChangeKind, RecommendedAction, Severity, ThreadStack, new_id


class IncidentState(StrEnum):
    """Where an incident is in its life."""

    OPEN = "open"
    ACKNOWLEDGED = "acknowledged"
    MITIGATED = "mitigated"  # the recovery it caused brought the job back to training; a person may still resolve it
    RESOLVED = "resolved"


ACTIVE_STATES = (IncidentState.OPEN, IncidentState.ACKNOWLEDGED)


# --- incidents ------------------------------------------------------------------------------------------------
class IncidentBase(SQLModel):
    """What an incident says: the job, its root cause and culprit, what to do, and when."""

    job_id: str = Field(max_length=64, index=True)
    state: IncidentState = Field(default=IncidentState.OPEN, sa_type=String(16), index=True)
    category: Category = Field(sa_type=String(32), index=True)
    severity: Severity = Field(sa_type=String(16))
    root_cause: str = Field(sa_type=Text)
    culprit_node_id: str | None = Field(default=None, max_length=64, index=True)
    culprit_gpu: int | None = None
    culprit_rank: int | None = None
    culprit_exit_code: int | None = None
    culprit_restart_epoch: int | None = Field(default=None, description="the launch the culprit rank belonged to")
    culprit_fault_step: int | None = Field(
        default=None, sa_type=BigInteger, description="a numeric fault's step: a restore picks an older checkpoint"
    )
    recommended_action: RecommendedAction = Field(sa_type=String(32))
    symptom_count: int = 0
    first_symptom_at: datetime = Field(sa_type=UTCDateTime)
    opened_at: datetime = Field(sa_type=UTCDateTime)
    updated_at: datetime = Field(sa_type=UTCDateTime)
    resolved_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    root_cause_at: datetime | None = Field(default=None, sa_type=UTCDateTime, description="time of the root symptom")
    acknowledged_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    stacks_verdict: str = Field(
        default="", sa_type=Text, description="the rank the captured stacks of a hang name, and why (empty: none)"
    )


class Incident(IncidentBase, table=True):
    """An incident row."""

    id: str = Field(default_factory=new_id, primary_key=True, max_length=32)


class IncidentPublic(IncidentBase):
    """An incident as the API returns it."""

    id: str


class IncidentsPublic(SQLModel):
    """A page of incidents and how many match in all."""

    data: list[IncidentPublic]
    count: int


# --- symptoms -------------------------------------------------------------------------------------------------
class SymptomBase(SQLModel):
    """One observed symptom, its classification, and the incident it joined (if any)."""

    event_id: str = Field(max_length=128)
    incident_id: str | None = Field(default=None, foreign_key="incident.id", index=True)
    node_id: str = Field(max_length=64, index=True)
    job_id: str | None = Field(default=None, max_length=64, index=True)
    kind: str = Field(max_length=64)
    gpu: int | None = None
    rank: int | None = None
    detail: str = Field(default="", sa_type=Text)
    time: datetime = Field(sa_type=UTCDateTime)
    received_at: datetime = Field(sa_type=UTCDateTime)
    category: Category = Field(sa_type=String(32))
    severity: Severity = Field(sa_type=String(16))
    recommended_action: RecommendedAction = Field(sa_type=String(32))
    root_cause_grade: bool
    reason: str = Field(sa_type=Text)
    decision: str | None = Field(
        default=None, max_length=16, description="open / attach / upgrade / suppress (evidence only) / record"
    )


class Symptom(SymptomBase, table=True):
    """A symptom row: one per event and affected job, so a redelivered event is never counted twice."""

    __table_args__ = (
        UniqueConstraint("event_id", "job_id", name="uq_symptom_event_job"),
        # NULLs are distinct in a unique constraint: a symptom that affects no placed job needs its own index.
        Index(
            "uq_symptom_event_unplaced",
            "event_id",
            unique=True,
            sqlite_where=text("job_id IS NULL"),
            postgresql_where=text("job_id IS NULL"),
        ),
    )

    id: str = Field(default_factory=new_id, primary_key=True, max_length=32)
    # The incident change this symptom caused and the symptom count it announced, so a redelivery re-publishes
    # exactly the same change (same message id) when the first publish was lost.
    change: IncidentChangeKind | None = Field(default=None, sa_type=String(16))
    change_seq: int | None = None


class SymptomPublic(SymptomBase):
    """A symptom as the API returns it."""

    id: str


# --- stacks ---------------------------------------------------------------------------------------------------
class RankStackBase(SQLModel):
    """The Python stacks of one rank, captured before a hang's recovery stopped it."""

    incident_id: str = Field(foreign_key="incident.id", index=True, max_length=32)
    job_id: str = Field(max_length=64)
    node_id: str = Field(max_length=64)
    rank: int
    restart_epoch: int | None = None
    pid: int | None = None
    proc_state: str = Field(default="", max_length=1)
    waits_in: str | None = Field(default=None, max_length=256, description="the collective its main thread waits in")
    error: str = Field(default="", sa_type=Text, description="why no stack was captured")
    capture_ms: float = 0.0
    captured_at: datetime = Field(sa_type=UTCDateTime)
    threads: list[ThreadStack] = Field(
        default_factory=list, sa_column=Column(TypedJSON(list[ThreadStack]), nullable=False)
    )


class RankStack(RankStackBase, table=True):
    """A rank's stacks, once per event (a redelivery is not stored twice)."""

    __tablename__ = "rank_stack"
    id: str = Field(default_factory=new_id, primary_key=True, max_length=32)
    event_id: str = Field(max_length=128, unique=True)


class RankStackPublic(RankStackBase):
    """A rank's stacks as the API returns them."""

    id: str


class IncidentDetail(IncidentPublic):
    """An incident with its symptoms, oldest first, and the stacks captured for it, by rank."""

    symptoms: list[SymptomPublic]
    stacks: list[RankStackPublic] = Field(default_factory=list)
