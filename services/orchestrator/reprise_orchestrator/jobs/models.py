"""Job records and their API shapes."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from pydantic import model_validator
from sqlalchemy import JSON, Column
from sqlmodel import Field, SQLModel

from reprise_common.clock import utcnow
from reprise_common.db import UTCDateTime
from reprise_common.settings import IdStr


class JobState(StrEnum):
    """Where a job is in its life."""

    PENDING = "pending"
    RUNNING = "running"
    RECOVERING = "recovering"
    FAILED = "failed"
    CANCELLED = "cancelled"


class RecoveryPolicy(SQLModel):
    """How a job may be recovered."""

    max_restarts: int = Field(default=10, ge=0, le=1000)
    non_retryable_exit_codes: list[int] = Field(default_factory=list)


class JobBase(SQLModel):
    """Fields a user provides."""

    name: str = Field(min_length=1, max_length=200)
    ranks_per_node: int = Field(default=1, ge=1, le=64)
    working_dir: str | None = Field(default=None, max_length=4096)
    checkpoint_dir: str | None = Field(default=None, max_length=4096)


class JobCreate(JobBase):
    """Body of POST /v1/jobs: either a node list or a node count."""

    nodes: list[IdStr] | None = Field(default=None, min_length=1, max_length=4096)
    node_count: int | None = Field(default=None, ge=1, le=4096)
    command: list[str] = Field(min_length=1)
    env: dict[str, str] = Field(default_factory=dict)
    policy: RecoveryPolicy = Field(default_factory=RecoveryPolicy)

    @model_validator(mode="after")
    def _nodes_or_count(self) -> JobCreate:
        if (self.nodes is None) == (self.node_count is None):
            raise ValueError("give exactly one of nodes (a list of node ids) or node_count")
        if self.nodes is not None and len(set(self.nodes)) != len(self.nodes):
            raise ValueError("nodes lists a node twice")
        return self


class Job(JobBase, table=True):
    """A job row; spec and placement are stored as JSON."""

    id: str = Field(primary_key=True)
    state: JobState = Field(default=JobState.PENDING, index=True)
    spec: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))
    placement: list[dict[str, Any]] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    restart_epoch: int = 0
    restarts: int = 0
    master_port: int = 0
    max_fence: int = Field(default=0, description="highest fencing token that has written to this job")
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    updated_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)

    def job_spec(self) -> JobCreate:
        """The spec the job was submitted with."""
        return JobCreate.model_validate(self.spec)


class JobPublic(JobBase):
    """A job as the API shows it."""

    id: str
    state: JobState
    restart_epoch: int
    restarts: int
    placement: list[dict[str, Any]]
    created_at: datetime
    updated_at: datetime


class JobsPublic(SQLModel):
    """A page of jobs."""

    data: list[JobPublic]
    count: int
