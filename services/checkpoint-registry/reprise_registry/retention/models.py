"""Pins: a checkpoint a running recovery uses is never deleted; and the answer of a retention pass."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Column, ForeignKey, Integer, String, UniqueConstraint
from sqlmodel import Field, SQLModel

from reprise_common.clock import utcnow
from reprise_common.db import UTCDateTime


class PinCreate(SQLModel):
    """Body of POST /v1/checkpoints/{id}/pins."""

    holder: str = Field(min_length=1, max_length=256, description="who uses it, e.g. the recovery id")
    ttl_s: float | None = Field(default=None, gt=0, description="expire after this long; none: until unpinned")


class CheckpointPin(SQLModel, table=True):
    """One holder's pin on a checkpoint."""

    __tablename__ = "checkpoint_pins"
    __table_args__ = (UniqueConstraint("checkpoint_id", "holder", name="uq_checkpoint_pins_holder"),)

    id: int | None = Field(default=None, primary_key=True)
    checkpoint_id: int = Field(
        sa_column=Column(Integer, ForeignKey("checkpoints.id", ondelete="CASCADE"), nullable=False, index=True)
    )
    holder: str = Field(sa_type=String(256))
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    expires_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class PinPublic(SQLModel):
    """A pin as the API shows it."""

    checkpoint_id: int
    holder: str
    created_at: datetime
    expires_at: datetime | None


class RetentionPolicy(SQLModel):
    """Keep the newest `keep_last` validated checkpoints plus every `keep_every`-th one ever validated."""

    keep_last: int = Field(default=3, ge=1)
    keep_every: int = Field(default=0, ge=0, description="0: none kept beyond keep_last")
    delete_files: bool = Field(
        default=False, description="remove the files too; refused (422) unless REPRISE_RETENTION_DELETE_FILES=true"
    )


class RetentionResult(SQLModel):
    """What a retention pass did for one job."""

    job_id: str
    kept: list[int]
    deleted: list[int]
    pinned: list[int]
    files_deleted: int
    errors: list[str] = Field(default_factory=list)
