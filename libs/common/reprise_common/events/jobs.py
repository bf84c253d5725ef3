"""The orchestrator's announcements: where a job's ranks run, how its recoveries go, what the compute backend saw."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import AwareDatetime, BeforeValidator, Field, PlainSerializer

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


class RecoveryOutcome(StrEnum):
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
    TRANSITION_REFUSED = "transition_refused"


def _blank_is_none(value: object) -> object:
    return None if value == "" else value


def _none_is_blank(value: StrEnum | None) -> str:
    return "" if value is None else value.value


# A step or an outcome that may be absent: None in the code, "" on the wire and in stored JSON (as it always was).
StepOrBlank = Annotated[RecoveryStep | None, BeforeValidator(_blank_is_none), PlainSerializer(_none_is_blank)]
OutcomeOrBlank = Annotated[RecoveryOutcome | None, BeforeValidator(_blank_is_none), PlainSerializer(_none_is_blank)]


class RecoveryChangeKind(StrEnum):
    """What happened to a recovery."""

    STARTED = "started"
    STEP = "step"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class RecoveryChange(Event):
    """A recovery started, moved to a new step, succeeded or failed."""

    type: Literal["recovery.change"] = "recovery.change"
    change: RecoveryChangeKind
    recovery_id: str
    job_id: str
    incident_id: str | None = None
    step: RecoveryStep
    fence: int = Field(ge=0)
    detail: str = ""
    attempt: int = Field(default=1, ge=1, description="which attempt of the recovery the step belongs to")
    outcome: OutcomeOrBlank = Field(default=None, description="why it ended (succeeded/failed only)")
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
