"""The orchestrator's announcements: where a job's ranks run, how its recoveries go, what the compute backend saw."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import AwareDatetime, Field

from reprise_common.events.base import Event, Wire


class RankAssignment(Wire):
    """Which node and GPU a rank runs on."""

    rank: int = Field(ge=0)
    node_id: str
    gpu: int | None = None
    local_rank: int = Field(ge=0)


class JobPlacement(Event):
    """The placement of a job's ranks for one restart epoch."""

    type: Literal["job.placement"] = "job.placement"
    job_id: str
    restart_epoch: int = Field(ge=0)
    world_size: int = Field(ge=0)
    ranks: list[RankAssignment] = Field(default_factory=list)
    active: bool = True
    hang_timeout_s: float | None = Field(default=None, gt=0, description="the job's fixed hang limit, if it set one")
    labels: dict[str, str] = Field(default_factory=dict, description="the job's labels, from its spec")

    def nodes(self) -> list[str]:
        """The distinct nodes of the placement, in rank order."""
        return list(dict.fromkeys(r.node_id for r in self.ranks))


class RecoveryChange(Event):
    """A recovery started, moved to a new step, succeeded or failed."""

    type: Literal["recovery.change"] = "recovery.change"
    change: Literal["started", "step", "succeeded", "failed"]
    recovery_id: str
    job_id: str
    incident_id: str | None = None
    step: str
    fence: int = Field(ge=0)
    detail: str = ""
    attempt: int = Field(default=1, ge=1, description="which attempt of the recovery the step belongs to")
    outcome: str = Field(default="", description="why it ended (succeeded/failed only): a reason code")
    step_started_at: AwareDatetime | None = Field(default=None, description="when the step began")
    labels: dict[str, str] = Field(default_factory=dict, description="the job's labels, from its spec")


class ComputeSignalKind(StrEnum):
    """A failure the compute backend (a cluster scheduler) saw on its own."""

    NODE_DOWN = "node_down"  # the scheduler set the node down
    NODE_NOT_RESPONDING = "node_not_responding"  # the scheduler lost contact with the node
    NODE_FAIL = "node_fail"  # the scheduler ended the job because one of its nodes failed
    PREEMPTED = "preempted"  # not a fault of the hardware: the job was preempted
    TIME_LIMIT = "time_limit"  # not a fault of the hardware: the job reached its time limit
    # the scheduler's controller does not answer: the job runs on, but nothing can be placed, drained or requeued
    CONTROLLER_UNAVAILABLE = "controller_unavailable"


class ComputeSignal(Event):
    """A failure signal of the compute backend, announced by the orchestrator that runs the backend."""

    type: Literal["compute.signal"] = "compute.signal"
    backend: str = Field(min_length=1, max_length=64)
    kind: ComputeSignalKind
    node_id: str | None = Field(default=None, max_length=256)
    job_id: str | None = Field(default=None, max_length=256)
    detail: str = Field(default="", max_length=2000)
