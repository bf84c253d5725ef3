"""Checkpoint records: one row per checkpoint of a job, its files, and which ranks reported."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import field_validator
from sqlalchemy import BigInteger, Column, ForeignKey, Index, Integer, String, UniqueConstraint
from sqlmodel import Field, SQLModel

from reprise_common.clock import utcnow
from reprise_common.db import SQL_INT_MAX, UTCDateTime
from reprise_common.settings import IdStr


class CheckpointState(StrEnum):
    """Where a checkpoint is in its life: only VALIDATED ones are ever handed out for a restore."""

    WRITING = "writing"
    COMMITTED = "committed"
    VALIDATED = "validated"
    CORRUPT = "corrupt"
    DELETED = "deleted"


class Layout(StrEnum):
    """How a checkpoint is laid out on storage, which decides its commit marker."""

    PER_RANK = "per_rank"  # rank-00003.pt per rank (reprise_sdk.torch.save_checkpoint)
    DCP = "dcp"  # torch.distributed.checkpoint: __<rank>_<n>.distcp plus .metadata, written last


class Algorithm(StrEnum):
    """Digest algorithms the registry verifies."""

    BLAKE3 = "blake3"
    SHA256 = "sha256"


DEFAULT_MARKER = {Layout.PER_RANK: "COMMITTED", Layout.DCP: ".metadata"}


# --- checkpoints --------------------------------------------------------------------------------------------
class CheckpointBase(SQLModel):
    """Fields a client provides when it begins a checkpoint."""

    job_id: IdStr = Field(sa_type=String(64))
    step: int = Field(ge=0, le=SQL_INT_MAX, sa_type=BigInteger)
    path: str = Field(min_length=1, max_length=4096, sa_type=String(4096))


class CheckpointCreate(CheckpointBase):
    """Body of POST /v1/checkpoints: begin a checkpoint (idempotent for the same job, step and path)."""

    world_size: int | None = Field(default=None, ge=1, le=1_000_000, description="ranks that must report")
    layout: Layout = Layout.PER_RANK
    marker: str | None = Field(
        default=None,
        min_length=1,
        max_length=255,
        description="commit marker file, relative to `path`; default by layout",
    )
    restart_epoch: int = Field(default=0, ge=0, le=SQL_INT_MAX)


class Checkpoint(CheckpointBase, table=True):
    """A checkpoint row."""

    __tablename__ = "checkpoints"
    __table_args__ = (
        UniqueConstraint("job_id", "step", name="uq_checkpoints_job_step"),
        Index("ix_checkpoints_job_state_step", "job_id", "state", "step"),
    )

    id: int | None = Field(default=None, primary_key=True)
    state: CheckpointState = Field(default=CheckpointState.WRITING, sa_type=String(16))
    layout: Layout = Field(default=Layout.PER_RANK, sa_type=String(16))
    marker: str = Field(default="COMMITTED", sa_type=String(255))
    world_size: int | None = None
    restart_epoch: int = 0
    manifest_digest: str | None = Field(default=None, sa_type=String(128))
    size_bytes: int | None = Field(default=None, sa_type=BigInteger)
    file_count: int | None = None
    reason: str = Field(default="", sa_type=String(1024))
    validated_seq: int | None = None
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    committed_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    validated_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    load_failed_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    load_failure: str = Field(default="", sa_type=String(1024))


class CheckpointPublic(CheckpointBase):
    """A checkpoint as the API shows it."""

    id: int
    state: CheckpointState
    layout: Layout
    marker: str
    world_size: int | None
    restart_epoch: int
    manifest_digest: str | None
    size_bytes: int | None
    file_count: int | None
    reason: str
    created_at: datetime
    committed_at: datetime | None
    validated_at: datetime | None
    load_failed_at: datetime | None
    load_failure: str


class CheckpointsPublic(SQLModel):
    """A page of checkpoints."""

    data: list[CheckpointPublic]
    count: int


# --- files and rank reports ---------------------------------------------------------------------------------
class FileReport(SQLModel):
    """One file a rank wrote, with the digest computed where the bytes are."""

    path: str = Field(
        min_length=1, max_length=4096, description="relative to the checkpoint's path, or absolute inside it"
    )
    size_bytes: int = Field(ge=0, le=SQL_INT_MAX)
    digest: str | None = Field(default=None, regex=r"^[0-9a-f]{16,128}$")
    algorithm: Algorithm = Algorithm.BLAKE3


class RankReport(SQLModel):
    """Body of POST /v1/checkpoints/{id}/ranks/{rank}: the files one rank wrote (all of them, at once)."""

    files: list[FileReport] = Field(default_factory=list, max_length=100_000)

    @field_validator("files")
    @classmethod
    def _distinct(cls, files: list[FileReport]) -> list[FileReport]:
        if len({f.path for f in files}) != len(files):
            raise ValueError("a file is listed twice")
        return files


class CheckpointFile(SQLModel, table=True):
    """One file of a checkpoint."""

    __tablename__ = "checkpoint_files"
    __table_args__ = (UniqueConstraint("checkpoint_id", "path", name="uq_checkpoint_files_path"),)

    id: int | None = Field(default=None, primary_key=True)
    checkpoint_id: int = Field(
        sa_column=Column(Integer, ForeignKey("checkpoints.id", ondelete="CASCADE"), nullable=False, index=True)
    )
    rank: int
    path: str = Field(sa_type=String(4096))
    size_bytes: int = Field(sa_type=BigInteger)
    digest: str | None = Field(default=None, sa_type=String(128))
    algorithm: Algorithm = Field(default=Algorithm.BLAKE3, sa_type=String(16))
    reported_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


class CheckpointFilePublic(SQLModel):
    """A file as the API shows it."""

    rank: int
    path: str
    size_bytes: int
    digest: str | None
    algorithm: Algorithm


class CheckpointFilesPublic(SQLModel):
    """A checkpoint's manifest."""

    data: list[CheckpointFilePublic]
    count: int


class SkippedCheckpoint(SQLModel):
    """A checkpoint a restore passed over, and why (its re-check found it corrupt)."""

    id: int
    step: int
    reason: str


class RestorePointPublic(SQLModel):
    """The checkpoint a restore should use, re-checked just now, and the ones skipped on the way to it."""

    checkpoint: CheckpointPublic | None = Field(description="none: no validated checkpoint passed its re-check")
    files: list[CheckpointFilePublic] = Field(description="its manifest, for the ranks to check what they load")
    digests_checked: bool = Field(description="the registry re-hashed every file (the manifest was too large to carry)")
    skipped: list[SkippedCheckpoint]


class CheckpointRank(SQLModel, table=True):
    """A rank that reported its part of a checkpoint (a rank may own no file)."""

    __tablename__ = "checkpoint_ranks"
    __table_args__ = (UniqueConstraint("checkpoint_id", "rank", name="uq_checkpoint_ranks_rank"),)

    id: int | None = Field(default=None, primary_key=True)
    checkpoint_id: int = Field(
        sa_column=Column(Integer, ForeignKey("checkpoints.id", ondelete="CASCADE"), nullable=False, index=True)
    )
    rank: int
    reported_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


class JobWorldSize(SQLModel, table=True):
    """The world size of a job's latest placement, for checkpoints reported without one (NATS path)."""

    __tablename__ = "job_world_sizes"

    job_id: str = Field(primary_key=True, sa_type=String(64))
    restart_epoch: int
    world_size: int


class LoadFailure(SQLModel):
    """Body of POST /v1/checkpoints/{id}/load-failed."""

    reason: str = Field(default="", max_length=1024)


class CommitResult(SQLModel):
    """Why a commit did or did not happen."""

    committed: bool
    missing_ranks: list[int] = Field(default_factory=list)
    marker_present: bool
    detail: str = ""
    checkpoint: CheckpointPublic
