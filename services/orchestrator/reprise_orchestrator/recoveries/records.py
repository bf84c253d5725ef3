"""What a recovery records of each step: one typed result per step, so resuming a recovery reads fields.

A recovery's `steps` column holds a list of StepRecord; each record's `data` is the result model of its step
(`DATA_OF`). The JSON keeps the shape the API always showed (the detected step's data is the incident itself), so
records written before the types existed read back as they are.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, SerializeAsAny, ValidationInfo, field_validator

from reprise_common.events import IncidentChange, RankAssignment
from reprise_orchestrator.compute.backend import CommandRecord
from reprise_orchestrator.jobs.placement import PlacementDecision
from reprise_orchestrator.recoveries.states import Outcome, RecoveryStep
from reprise_orchestrator.registry_client import SkippedCheckpoint


class Then(StrEnum):
    """What a step's result asks to happen next."""

    NEXT = "next"  # go on with the next step
    RETRY = "retry"  # a new attempt from stopping_ranks, after a backoff
    STOP = "stop"  # the recovery ends with the result's outcome (the job fails, or is held for a human)


class VerifyPath(StrEnum):
    """How a verifying step found the new epoch healthy."""

    STEPS = "steps"  # every rank reported a step at or past the restored checkpoint's (the SDK)
    SETTLED = "alive_past_settle"  # no SDK: every rank alive and working for the policy's settle time
    COMPLETED = "completed"  # every rank exited 0: training ended while it was verified


class StepData(BaseModel):
    """Base of every step's result; unknown fields of older records are ignored."""

    model_config = ConfigDict(extra="ignore")


class Baseline(StepData):
    """The job's progress counters when the recovery was claimed (what the give-up rules compare against)."""

    last_restore_step: int | None = None
    no_progress_streak: int = 0
    same_error_streak: int = Field(default=1, description="recoveries in a row answering this error, this one too")
    sdk_seen: bool = Field(default=False, description="a rank of the epoch the incident hit reported SDK progress")


class Locked(StepData):
    """The claim."""

    baseline: Baseline = Field(default_factory=Baseline)


class Stopped(StepData):
    """The fenced stop to every node the job ran on."""

    answers: CommandRecord = Field(default_factory=CommandRecord)
    agents_gone: list[str] = Field(default_factory=list)
    not_asked: list[str] = Field(
        default_factory=list,
        description="nodes the incident says are gone: not waited for (their ranks are stopped if they come back)",
    )
    stacks_for: str | None = Field(default=None, description="the incident the ranks' stacks were captured for")
    restart_mode: Literal["in_place", "cold"] = Field(
        default="cold", description="in_place: some ranks parked and keep their processes; cold: every rank stopped"
    )
    parked: int = Field(default=0, ge=0, description="ranks parked for a restart in place")
    why: str = Field(default="", description="why the recovery took that path")


class Isolated(StepData):
    """Which nodes the new placement leaves out, and the node cordoned, if any."""

    excluded: list[str] = Field(default_factory=list)
    cordoned: str | None = None
    culprit: str | None = Field(default=None, description="the culprit node of the incident this plan answers")
    symptoms: int = Field(default=0, description="the symptom count of the incident version this plan answers")
    note: str = ""


class Placed(StepData):
    """Where the job runs next."""

    decision: PlacementDecision | None = None
    nodes: list[str] = Field(default_factory=list)
    replaced: dict[str, str] = Field(default_factory=dict)
    dropped: list[str] = Field(default_factory=list)
    world_size: int = 0
    ranks: list[RankAssignment] = Field(default_factory=list)


class CheckpointRef(BaseModel):
    """A validated checkpoint the recovery restores."""

    id: int
    step: int
    path: str


class Restored(StepData):
    """The checkpoint chosen (pinned while the recovery runs), or none, and the newer ones skipped as corrupt."""

    checkpoint: CheckpointRef | None = None
    pinned: bool = False
    skipped: list[SkippedCheckpoint] = Field(default_factory=list)
    digests_checked: bool = Field(
        default=False, description="the registry re-hashed every file (too many for the ranks to be handed)"
    )
    before_step: int | None = Field(default=None, description="a numeric fault's step: only older checkpoints")
    note: str = ""


class Launched(StepData):
    """The new epoch's launch."""

    restart_epoch: int | None = None
    master_port: int | None = None
    answers: CommandRecord | None = None
    in_place: int = Field(default=0, ge=0, description="ranks handed the new epoch in their running processes")
    error: str = ""


class Resumed(BaseModel):
    """Where the new epoch's ranks took their state from, as their SDK said: a surviving peer (at `step`) or the
    checkpoint, and why (docs/sdk.md, peer recovery)."""

    via: str = Field(max_length=16)
    step: int | None = Field(default=None, ge=0)
    why: str = Field(default="", max_length=512)


class Verified(StepData):
    """Whether the new epoch trains: every rank past the restored step, alive past the settle time, or finished."""

    target_step: int = 0
    steps: dict[str, int | None] = Field(default_factory=dict)
    missing: list[int] = Field(default_factory=list)
    dead_ranks: list[int] = Field(default_factory=list)
    load_failed: bool | None = None
    learned: str = Field(default="", description="what the incident learned while the new epoch was verified")
    path: VerifyPath | None = Field(default=None, description="how it passed (none: it did not)")
    finished: list[int] = Field(default_factory=list, description="ranks that exited 0 (training ended)")
    settle_s: float | None = Field(default=None, description="the settle time, when verified without steps")
    cpu_s: dict[str, float | None] = Field(
        default_factory=dict, description="CPU seconds each rank used in the settle time's second half (none: unknown)"
    )
    io_bytes: dict[str, int | None] = Field(
        default_factory=dict, description="I/O bytes each rank moved in the settle time's 2nd half (none: unknown)"
    )
    resumed: Resumed | None = Field(default=None, description="where the ranks' state came from (the SDK's replica)")


class Ended(StepData):
    """A recovery's end (running, failed or held): its detail is on the recovery."""


DATA_OF: dict[RecoveryStep, type[BaseModel]] = {
    RecoveryStep.DETECTED: IncidentChange,
    RecoveryStep.LOCKED: Locked,
    RecoveryStep.STOPPING_RANKS: Stopped,
    RecoveryStep.ISOLATING: Isolated,
    RecoveryStep.PLACING: Placed,
    RecoveryStep.RESTORING: Restored,
    RecoveryStep.LAUNCHING: Launched,
    RecoveryStep.VERIFYING: Verified,
    RecoveryStep.RUNNING: Ended,
    RecoveryStep.FAILED: Ended,
    RecoveryStep.HELD: Ended,
}


class StepRecord(BaseModel):
    """One step of one attempt, with its start, end (None while it runs), result and what the result asked for."""

    step: RecoveryStep
    attempt: int = Field(default=1, ge=1)
    started_at: AwareDatetime
    ended_at: AwareDatetime | None = None
    data: SerializeAsAny[BaseModel] = Field(default_factory=Ended, validate_default=True)
    then: Then = Then.NEXT
    outcome: Outcome | None = None

    @field_validator("data", mode="before")
    @classmethod
    def _typed_by_step(cls, value: Any, info: ValidationInfo) -> Any:
        kind = DATA_OF.get(info.data.get("step", RecoveryStep.FAILED), Ended)
        if isinstance(value, kind):
            return value
        return kind.model_validate(value.model_dump() if isinstance(value, BaseModel) else value or {})

    @property
    def done(self) -> bool:
        """True once the step ended."""
        return self.ended_at is not None


def incident_of(records: list[StepRecord]) -> IncidentChange:
    """The incident a recovery was claimed for (its detected step)."""
    data = records[0].data
    assert isinstance(data, IncidentChange), records[0].step
    return data


def baseline_of(records: list[StepRecord]) -> Baseline:
    """The job's counters when the recovery was claimed (its locked step)."""
    locked = next((r.data for r in records if isinstance(r.data, Locked)), None)
    return locked.baseline if locked is not None else Baseline()
