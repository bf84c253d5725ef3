"""Recovery records: one row per recovery, every step with its start and end time."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import JSON, Column
from sqlmodel import Field, SQLModel

from reprise_common.clock import utcnow
from reprise_common.db import UTCDateTime


class RecoveryStep(StrEnum):
    """The steps of a recovery, in order; a recovery ends in RUNNING or FAILED (or HELD, waiting for a human)."""

    DETECTED = "detected"
    LOCKED = "locked"
    STOPPING_RANKS = "stopping_ranks"
    ISOLATING = "isolating"
    PLACING = "placing"
    RESTORING = "restoring"
    LAUNCHING = "launching"
    VERIFYING = "verifying"
    RUNNING = "running"
    FAILED = "failed"
    HELD = "held"


TERMINAL_STEPS = frozenset({RecoveryStep.RUNNING, RecoveryStep.FAILED, RecoveryStep.HELD})


class Outcome(StrEnum):
    """Why a recovery ended as it did."""

    RECOVERED = "recovered"
    BUDGET_SPENT = "restart_budget_spent"
    NON_RETRYABLE = "non_retryable_exit_code"
    SAME_ERROR = "same_error_repeated"
    NO_PROGRESS = "no_checkpoint_progress"
    CIRCUIT_BREAKER = "circuit_breaker_open"
    HUMAN_ASKED = "detector_asked_for_a_human"
    NO_CAPACITY = "no_capacity"
    ATTEMPTS_SPENT = "attempts_spent"
    REGISTRY_UNAVAILABLE = "registry_unavailable"
    CANCELLED = "cancelled"


class Recovery(SQLModel, table=True):
    """One recovery of one job, owned by the holder of its fencing token."""

    id: str = Field(primary_key=True)
    job_id: str = Field(index=True, foreign_key="job.id")
    incident_id: str | None = None
    attached_incidents: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    fence: int = Field(index=True)
    owner: str
    step: RecoveryStep = Field(default=RecoveryStep.DETECTED, index=True)
    steps: list[dict[str, Any]] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
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
    steps: list[dict[str, Any]]
    attempt: int
    outcome: Outcome | None
    detail: str
    started_at: datetime
    finished_at: datetime | None


class RecoveriesPublic(SQLModel):
    """A job's recoveries."""

    data: list[RecoveryPublic]
    count: int
