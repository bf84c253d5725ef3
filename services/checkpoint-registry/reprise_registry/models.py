"""Checkpoint records: one row per checkpoint of a job, with its lifecycle state."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from sqlmodel import Field, SQLModel

from reprise_common.clock import utcnow
from reprise_common.db import UTCDateTime
from reprise_common.settings import IdStr


class CheckpointState(StrEnum):
    """Where a checkpoint is in its life: only VALIDATED ones are ever handed out for a restore."""

    WRITING = "writing"
    COMMITTED = "committed"
    VALIDATED = "validated"
    CORRUPT = "corrupt"
    DELETED = "deleted"


class CheckpointBase(SQLModel):
    """Fields a client provides when it begins a checkpoint."""

    job_id: IdStr = Field(index=True)
    step: int = Field(ge=0, index=True)
    path: str = Field(min_length=1, max_length=4096)


class CheckpointCreate(CheckpointBase):
    """Body of POST /v1/checkpoints."""


class Checkpoint(CheckpointBase, table=True):
    """A checkpoint row."""

    id: int | None = Field(default=None, primary_key=True)
    state: CheckpointState = Field(default=CheckpointState.WRITING, index=True)
    manifest_digest: str | None = None
    size_bytes: int | None = None
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    validated_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class CheckpointPublic(CheckpointBase):
    """A checkpoint as the API shows it."""

    id: int
    state: CheckpointState
    manifest_digest: str | None
    size_bytes: int | None
    created_at: datetime
    validated_at: datetime | None


class CheckpointsPublic(SQLModel):
    """A page of checkpoints."""

    data: list[CheckpointPublic]
    count: int
