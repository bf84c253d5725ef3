"""Drill records and their API shapes."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from sqlmodel import Field, SQLModel

from reprise_common.clock import utcnow
from reprise_common.db import UTCDateTime


class DrillFault(StrEnum):
    """The faults a drill can inject."""

    KILL_RANK = "kill-rank"  # SIGKILL one rank
    XID79 = "xid79"  # the rank's GPU falls off the bus (simulated GPUs)
    HANG = "hang"  # SIGSTOP one rank
    NODE_LOSS = "node-loss"  # the rank's node loses its agent and every rank


class DrillState(StrEnum):
    """Where a drill is."""

    RUNNING = "running"
    PASSED = "passed"  # recovered within the objective
    MISSED = "missed"  # recovered, but slower than the objective
    FAILED = "failed"  # no recovery, or the recovery failed


class DrillCreate(SQLModel):
    """Body of POST /v1/jobs/{job_id}/drills."""

    fault: DrillFault
    rank: int | None = Field(default=None, ge=0, description="the rank to hit (default: the job's last rank)")


class DrillBase(SQLModel):
    """What a drill did and measured."""

    job_id: str = Field(index=True, max_length=64)
    fault: DrillFault
    rank: int
    node_id: str
    state: DrillState = DrillState.RUNNING
    objective_s: float
    recovery_id: str | None = None
    detection_s: float | None = Field(default=None, description="fault injected → incident opened")
    recovery_s: float | None = Field(default=None, description="fault injected → training progressing again")
    detail: str = ""
    injected_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    finished_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class Drill(DrillBase, table=True):
    """A drill row."""

    id: str = Field(primary_key=True)


class DrillPublic(DrillBase):
    """A drill as the API shows it."""

    id: str


class DrillsPublic(SQLModel):
    """A job's drills."""

    data: list[DrillPublic]
    count: int
