"""Incident and symptom tables and their public shapes (SQLModel families)."""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import DateTime, Index, String, Text, UniqueConstraint, text
from sqlalchemy.engine import Dialect, Engine
from sqlalchemy.types import TypeDecorator
from sqlmodel import Field, SQLModel

from reprise_common.events import Category, RecommendedAction, Severity, new_id


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware timestamp stored in UTC; SQLite keeps no zone, so values read back are marked UTC."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        """Refuse naive times; store UTC (without a zone on SQLite, which cannot keep one)."""
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime: Reprise stores UTC-aware timestamps only")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        """Every timestamp read back is UTC-aware."""
        if value is None:
            return None
        stamp: datetime = value
        return stamp.replace(tzinfo=UTC) if stamp.tzinfo is None else stamp.astimezone(UTC)


class IncidentState(StrEnum):
    """Where an incident is in its life."""

    OPEN = "open"
    ACKNOWLEDGED = "acknowledged"
    RESOLVED = "resolved"


ACTIVE_STATES = (IncidentState.OPEN, IncidentState.ACKNOWLEDGED)


class IncidentChangeKind(StrEnum):
    """The change an IncidentChange event announces."""

    OPENED = "opened"
    UPDATED = "updated"
    RESOLVED = "resolved"


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
    recommended_action: RecommendedAction = Field(sa_type=String(32))
    symptom_count: int = 0
    first_symptom_at: datetime = Field(sa_type=UTCDateTime)
    opened_at: datetime = Field(sa_type=UTCDateTime)
    updated_at: datetime = Field(sa_type=UTCDateTime)
    resolved_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


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


class IncidentDetail(IncidentPublic):
    """An incident with its symptoms, oldest first."""

    symptoms: list[SymptomPublic]


def create_tables(engine: Engine) -> None:
    """Create the detector's tables (only these, whatever else shares SQLModel's metadata) if missing."""
    tables = [SQLModel.metadata.tables[str(model.__tablename__)] for model in (Incident, Symptom)]
    SQLModel.metadata.create_all(engine, tables=tables)
