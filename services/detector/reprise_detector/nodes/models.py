"""Node fault history, quarantine recommendations and per-job hang policies (SQLModel tables and public shapes)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import String, Text, UniqueConstraint
from sqlmodel import Field, SQLModel

from reprise_common.db import UTCDateTime
from reprise_common.events import Category, QuarantineReason, new_id


class NodeFaultBase(SQLModel):
    """One hardware fault seen on a node, for one affected job (job_key "" when it hit no placed job)."""

    node_id: str = Field(max_length=64, index=True)
    event_id: str = Field(max_length=128)
    job_key: str = Field(default="", max_length=64)
    kind: str = Field(max_length=64)
    xid: int | None = None
    gpu: int | None = None
    category: Category = Field(sa_type=String(32))
    reason: str = Field(default="", sa_type=Text)
    time: datetime = Field(sa_type=UTCDateTime, index=True)


class NodeFault(NodeFaultBase, table=True):
    """A fault row; one per (event, job) so a redelivered event is never counted twice."""

    __table_args__ = (UniqueConstraint("event_id", "job_key", name="uq_nodefault_event_job"),)

    id: str = Field(default_factory=new_id, primary_key=True, max_length=32)


class NodeFaultPublic(NodeFaultBase):
    """A fault as the API returns it."""


class QuarantineBase(SQLModel):
    """A recommendation to quarantine a node, with the rule that fired and the history behind it."""

    node_id: str = Field(max_length=64, index=True)
    reason: QuarantineReason = Field(sa_type=String(32))
    detail: str = Field(sa_type=Text)
    fault_count: int
    job_ids: str = Field(default="", sa_type=Text, description="comma-separated")
    first_fault_at: datetime = Field(sa_type=UTCDateTime)
    last_fault_at: datetime = Field(sa_type=UTCDateTime)
    recommended_at: datetime = Field(sa_type=UTCDateTime)
    published: bool = False


class Quarantine(QuarantineBase, table=True):
    """A recommendation row; its id is the message id of the event that announces it."""

    id: str = Field(primary_key=True, max_length=128)


class QuarantinePublic(QuarantineBase):
    """A recommendation as the API returns it."""

    id: str


DAY_S = 86400.0  # the longest hang limit a job may set


class HangPolicyBase(SQLModel):
    """A job's own hang limits; a field left null keeps the detector's default."""

    timeout_s: float | None = Field(default=None, gt=0, le=DAY_S, description="fixed training limit (replaces k x p99)")
    floor_s: float | None = Field(default=None, gt=0, le=DAY_S)
    k: float | None = Field(default=None, gt=0, le=1000)
    startup_s: float | None = Field(default=None, gt=0, le=DAY_S)
    checkpointing_s: float | None = Field(default=None, gt=0, le=DAY_S)
    evaluating_s: float | None = Field(
        default=None, gt=0, le=DAY_S, description="while the rank's phase is eval, evaluation or validation"
    )
    loading_data_s: float | None = Field(default=None, gt=0, le=DAY_S, description="while its phase is data_loading")


class HangPolicy(HangPolicyBase, table=True):
    """A job's hang policy row."""

    job_id: str = Field(primary_key=True, max_length=64)
    updated_at: datetime = Field(sa_type=UTCDateTime)


class HangPolicyPublic(HangPolicyBase):
    """A job's hang policy as the API returns it."""

    job_id: str
    updated_at: datetime


class GpuHealthPublic(SQLModel):
    """One GPU as the node's last report described it."""

    index: int
    health: str
    last_xid: int | None = None


class NodeHealthPublic(SQLModel):
    """A node's liveness (this replica's view), its recent faults and any quarantine recommendation."""

    node_id: str
    state: str
    last_report_age_s: float | None
    gpus: list[GpuHealthPublic]
    fault_count: int
    jobs_with_faults: list[str]
    quarantine_recommended: bool
    faults: list[NodeFaultPublic] = []
    recommendations: list[QuarantinePublic] = []


class NodesHealthPublic(SQLModel):
    """Every node this replica has heard from or holds faults for."""

    data: list[NodeHealthPublic]
    count: int
